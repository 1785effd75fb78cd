"""How `generate` keeps the keys and values of the tokens so far, and the static cache that lets
transformers compile the decoding step on a GPU (`sampling.generate(cache=...)`; which one a
device gets: `sampling.default_cache`)."""
import os
import shutil
import sys
import types

import torch
from transformers import StaticCache


# How `generate` keeps the keys and values of the tokens so far (`cache=`):
PREFIX = "prefix"    # HF's DynamicCache, each prompt prefilled once and shared by its samples:
                     # the fewest FLOPs, the fastest on a CPU
STATIC = "static"    # HF's StaticCache, every shape fixed for the call, so that on a GPU
                     # transformers compiles the decoding forward and replays it as a CUDA graph:
                     # a small model's step is then bound by the card, not by the host
PROMPT_BUCKET = 64   # static: prompts left-padded to a multiple of this, so that a run's calls
                     # share a few compiled shapes instead of compiling one per prompt width


def static_cache(model, batch_size, max_cache_len):
    """transformers' StaticCache for this call's shape, kept on the model and reset between calls
    of the same shape: its tensors keep their addresses, so that the CUDA graphs captured for
    them replay rather than being captured again. Keys and values each keep the dtype they come
    in: under autocast RoPE leaves the keys in float32 while the values are bfloat16, and
    transformers' static layer would store both in the keys' dtype."""
    shape = (batch_size, max_cache_len)
    kept = getattr(model, "_tba_static_cache", None)
    if kept is not None and kept[0] == shape:
        kept[1].reset()
        return kept[1]
    cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
    for layer in cache.layers:
        layer.lazy_initialization = types.MethodType(own_dtypes(type(layer).lazy_initialization),
                                                     layer)
    model._tba_static_cache = (shape, cache)
    return cache


def own_dtypes(lazy_initialization):
    """A static layer's first update: its values stored in the values' own dtype."""
    def initialize(layer, key_states, value_states):
        lazy_initialization(layer, key_states, value_states)
        if layer.values.dtype != value_states.dtype:
            layer.values = torch.zeros_like(layer.values, dtype=value_states.dtype)
            torch._dynamo.mark_static_address(layer.values)
    return initialize


_COMPILE_CHECKED = {}


def compile_works():
    """Can torch.compile build CUDA graphs here? It needs torch ≥ 2.6 and a C compiler (Triton
    builds its launchers with one). If not, say so once and decode eagerly."""
    if "ok" not in _COMPILE_CHECKED:
        version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
        compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
        reason = ("torch < 2.6" if version < (2, 6) else
                  "no C compiler (cc, gcc or $CC)" if not compiler else None)
        if reason:
            print(f"tba: decoding eagerly on the GPU: {reason}, which torch.compile needs",
                  file=sys.stderr, flush=True)
        _COMPILE_CHECKED["ok"] = reason is None
    return _COMPILE_CHECKED["ok"]
