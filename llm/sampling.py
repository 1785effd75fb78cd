"""Sampling: K completions per prompt with HF `generate`, and the log-probs of the distribution
that sampled them (`TemperatureAndLogMu`, at no extra forward pass). The caches `generate` may
use, and the static one a GPU compiles, are `static_decoding.py`'s."""
import torch
from transformers import (GenerationConfig, LogitsProcessor, LogitsProcessorList, StoppingCriteria,
                          StoppingCriteriaList)

from llm.logprobs import prompt_attention_mask
from llm.static_decoding import PREFIX, PROMPT_BUCKET, STATIC, compile_works, static_cache


def default_cache(device):
    """STATIC where transformers compiles it (a CUDA GPU with a usable compiler), else PREFIX:
    a CPU step never enters static_decoding.py."""
    return STATIC if torch.device(device).type == "cuda" and compile_works() else PREFIX


def left_pad(sequences, pad_id, multiple=1):
    """Token lists -> ids, mask: [B, P], padded on the left so that generation continues them;
    P the longest rounded up to a `multiple`."""
    width = -(-max(map(len, sequences)) // multiple) * multiple
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, seq in enumerate(sequences):
        ids[i, width - len(seq):] = torch.as_tensor(seq, dtype=torch.long)
        mask[i, width - len(seq):] = 1
    return ids, mask


def ended_by_eos(sequences, eos_id):
    """Token lists written, not sampled, as completions: each ended by EOS, right padded (with
    EOS). -> response_ids [m, R], response_len [m] (the EOS counted)"""
    lengths = torch.tensor([len(seq) + 1 for seq in sequences])                 # [m]
    ids = torch.full((len(sequences), int(lengths.max())), eos_id, dtype=torch.long)
    for i, seq in enumerate(sequences):
        ids[i, :len(seq)] = torch.as_tensor(seq, dtype=torch.long)
    return ids, lengths


def eos_ids(model, tokenizer):
    ids = model.generation_config.eos_token_id
    ids = set(ids if isinstance(ids, list) else [ids]) | {tokenizer.eos_token_id}
    return sorted(i for i in ids if i is not None)


class StopOnEvent(StoppingCriteria):
    def __init__(self, event):
        self.event = event

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), self.event.is_set(), device=input_ids.device)


class TemperatureAndLogMu(LogitsProcessor):
    """Pure sampling at a temperature per row (a number, or [N, 1]: HF has one per call, so HF's
    is left at 1), recording log μ of every sampled token under the distribution that really
    drew it (these weights, this temperature, generation's own cache and precision). HF calls a
    processor with step t's logits *before* step t's token is drawn: each call keeps its
    log-softmax (`undrawn_logp`, the one [N, V] tensor held, replaced every step) and scores it
    at the next call with the token drawn from it; `token_logp(new_ids)`, after `generate`,
    scores the last. `record` False: scaling only."""

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
             greedy=False, stop_event=None, with_logprobs=False, cache=None):
    """Sample `num_samples` completions for each prompt with HF `generate`: pure sampling at
    `temperature` (a number, or [B]: one per prompt), every other logits processor off, since
    the trainer scores completions with exactly that distribution.
    -> prompt_ids, prompt_mask [B, P] (left-padded), response_ids [B, n, R] (right-padded),
    response_len [B, n] (up to and including the first EOS, or R: never from `token == pad_id`,
    as SmolLM2 pads with its EOS), and with `with_logprobs` log μ(y|x) [B, n] summed over each
    response. A set `stop_event` ends generation after the current token.

    `cache` (default: `default_cache(device)`): PREFIX computes each prompt's keys and values
    once, not once per sample: all but its last token are prefilled (`prefill`, which also keeps
    every pad position's attention row from being empty) and the cache repeated
    `num_samples`-fold; the random draws are those of the prompts repeated first, so a seed
    gives the same tokens (tests/test_models.py). STATIC prefills every sample's copy of its
    prompt into a cache of fixed size, prompts padded to a multiple of PROMPT_BUCKET, and on a
    CUDA GPU transformers compiles the decoding step (compiled only there: on a CPU it runs
    eagerly unless `model.generation_config.compile_config` asks otherwise). Both sample the
    same distribution, the one the trainer scores (tests/test_models.py)."""
    device = next(model.parameters()).device
    cache = cache or default_cache(device)
    ids, mask = left_pad(prompt_ids, tokenizer.pad_token_id,
                         multiple=PROMPT_BUCKET if cache == STATIC else 1)     # [B, P]
    ids, mask = ids.to(device), mask.to(device)
    b, p = ids.shape
    padded = min(map(len, prompt_ids)) < p                 # known on the host: no device read
    past = None
    if cache == PREFIX and p > 1 and (num_samples > 1 or padded):
        past = prefill(model, ids, mask, padded)                               # [B, ·, P-1, ·]
        past.batch_repeat_interleave(num_samples)                              # [B·n, ·, P-1, ·]
    eos = eos_ids(model, tokenizer)
    static = {}
    if cache == STATIC:
        past = static_cache(model, b * num_samples, p + max_new_tokens)
        if p > 1:                                                          # [B·n, ·, P+R, ·]
            prefill(model, ids.repeat_interleave(num_samples, 0),
                    mask.repeat_interleave(num_samples, 0), padded, past, p + max_new_tokens)
        static = dict(disable_compile=torch.device(device).type == "cuda" and not compile_works())
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=not greedy, pad_token_id=tokenizer.pad_token_id,
        # Greedy: top_k at transformers' own default, which greedy search ignores; left unset it
        # would come from the model's config (0), which transformers warns about on every call.
        eos_token_id=eos, **static, **(dict(top_k=50) if greedy
                                       else dict(temperature=1.0, top_k=0, top_p=1.0)))
    stopping = StoppingCriteriaList([StopOnEvent(stop_event)] if stop_event is not None else [])
    if isinstance(temperature, torch.Tensor):                                  # [B] -> [B·n, 1]
        temperature = temperature.to(device).repeat_interleave(num_samples)[:, None]
    sampler = TemperatureAndLogMu(temperature, record=with_logprobs)
    out = model.generate(input_ids=ids.repeat_interleave(num_samples, 0),       # [B·n, P + R]
                         attention_mask=mask.repeat_interleave(num_samples, 0),
                         past_key_values=past, generation_config=config,
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


def prefill(model, ids, mask, padded, cache=None, key_width=None):
    """Run all but the last token of left-padded prompts ids, mask [N, P] into `cache` (None: a
    new DynamicCache), for `generate` to continue. Ours rather than generate's own prefill so
    that no query row of a pad position has every key masked (`prompt_attention_mask`): GPU
    attention kernels may return NaN for such a row. `padded`: whether any prompt is shorter
    than P; `key_width`: the slots of a static `cache`.                          -> the cache"""
    attention = prompt_attention_mask(model, mask[:, :-1], padded, key_width)
    return model.base_model(input_ids=ids[:, :-1], attention_mask=attention,
                            position_ids=(mask[:, :-1].cumsum(-1) - 1).clamp(min=0),
                            past_key_values=cache, use_cache=True).past_key_values


def decode(tokenizer, response_ids, response_len):
    """[B, n, R] ids -> B·n strings, each cut at its length (special tokens dropped)."""
    flat_ids, flat_len = response_ids.flatten(0, 1).tolist(), response_len.flatten().tolist()
    return tokenizer.batch_decode([ids[:n] for ids, n in zip(flat_ids, flat_len)],
                                  skip_special_tokens=True)
