"""The fast path for sequence log-probs, the trainer's default: each prompt computed once for all
its completions, the output layer run a chunk of positions at a time, activation checkpointing.

`trainer.sequence_logprobs` is the plain definition (one forward pass per whole sequence); the
tests hold this path to it, log-probs and gradients. `check_logprobs` checks a model against its
own numbers once at load time, since a model that post-processes its logits or caches otherwise
would be trained on another distribution than it samples.
"""
import functools

import torch
from torch.utils.checkpoint import checkpoint
from transformers.cache_utils import DynamicCache, DynamicLayer
from transformers.modeling_layers import GradientCheckpointingLayer

from batch import GroupBatch


def token_logprobs(head, hidden, targets, temperature):
    """log p(target) at each position from the decoder's last hidden states.      -> [N, c]

    hidden: [N, c, H], targets: [N, c]. Float32 from the logits on, whatever the model's dtype.
    """
    logits = head(hidden).float() / temperature                              # [N, c, V]
    chosen = logits.gather(-1, targets[..., None]).squeeze(-1)               # [N, c]
    return chosen - torch.logsumexp(logits, dim=-1)                          # [N, c]


class PromptRecorder(DynamicLayer):
    """One decoder layer's cache in the prompt pass: it keeps the prompt's keys and values. It
    assigns rather than appends, so a layer recomputed under activation checkpointing stores the
    same tensors again instead of doubling them."""

    def update(self, key_states, value_states, *args, **kwargs):
        self.keys, self.values, self.is_initialized = key_states, value_states, True
        return key_states, value_states                                       # [n, heads, P, d]


class PromptReader(DynamicLayer):
    """One decoder layer's cache in the completion pass: the prompt's keys and values, a row per
    completion, read and never written. `update` returns them followed by the completion's own
    and keeps nothing, so a recomputed layer reads the same cache as the first time."""

    def __init__(self, keys, values):
        super().__init__()
        self.keys, self.values, self.is_initialized = keys, values, True    # [m, heads, P, d]

    def update(self, key_states, value_states, *args, **kwargs):
        return (torch.cat([self.keys, key_states], -2),                       # [m, heads, P+r, d]
                torch.cat([self.values, value_states], -2))


def cache_of(layers):
    """An HF cache made of these layers (one per decoder layer)."""
    cache = DynamicCache()
    cache.layers = layers
    return cache


def prompt_attention_mask(model, prompt_mask, padded, key_width=None):
    """The attention mask of a pass over left-padded prompts, in which no query row has every key
    masked: a pad position attends to itself alone, a real token to the real tokens up to it.
    prompt_mask: [n, P], 1 on real tokens; `padded`: whether any prompt is shorter than P, a
    bool the caller knows on the host. Unpadded: `prompt_mask` itself, which transformers turns
    into the plain causal path.                           -> [n, P], or [n, 1, P, P] when padded

    Why: with transformers' own mask a pad position of a shorter prompt is a query row with
    every key masked. A CPU returns 0 for such a row; GPU kernels may return NaN (cuDNN's SDPA
    backward, pytorch/pytorch#196678), and a NaN times the zero gradient of a pad row is still
    NaN in the weights'. A real token's row is the same in both masks, so its log-probs are too.
    Built for "sdpa" (booleans) and "eager" (0 / -inf to add); other attention implementations
    (flash attention drops the pad positions) get the 2-D mask as before. `key_width`: the keys
    a cache of fixed size holds (sampling's static cache), the slots after the prompt masked."""
    implementation = model.config._attn_implementation
    if not padded or implementation not in ("sdpa", "eager"):
        return prompt_mask
    n, p = prompt_mask.shape
    earlier = torch.ones(p, p, dtype=torch.bool, device=prompt_mask.device).tril()   # [P, P]
    itself = torch.eye(p, dtype=torch.bool, device=prompt_mask.device)                # [P, P]
    seen = (earlier & prompt_mask.bool()[:, None, :]) | itself                        # [n, P, P]
    if key_width is not None:                                                 # [n, P, key_width]
        seen = torch.nn.functional.pad(seen, (0, key_width - p), value=False)
    if implementation == "sdpa":
        return seen[:, None]                                                     # [n, 1, P, P]
    blocked = torch.finfo(model.dtype).min
    return torch.zeros(seen.shape, device=seen.device).masked_fill(~seen, blocked)[:, None]


def completion_logprobs(model, prompt_ids, prompt_mask, response_ids, response_len, owner,
                        temperature=1.0, chunk_size=64, widths=None):
    """Sum of log p(token) over the response tokens of m completions, completion i continuing
    prompt owner[i]; each prompt is computed once however many completions continue it.  -> [m]

    prompt_ids, prompt_mask: [n, P], left-padded; response_ids: [m, R], right-padded;
    response_len: [m], the tokens up to and including the EOS that ended each (never found from
    `token == pad_id`: pad and EOS may be the same id); owner: [m], values in 0..n-1.

    A first pass runs the n prompts and keeps every layer's keys and values; a second runs the m
    completions against them (`PromptReader`: row i is its prompt's), at the positions that
    follow the prompt's real tokens, as in generation. Autograd sums a prompt's gradient over the
    completions that read it: the log-probs and gradients of m full sequences (the tests check
    both), for the prompt's FLOPs once instead of m/n times.

    Memory: the output layer runs `chunk_size` positions at a time, each chunk under activation
    checkpointing when gradients are on, so only the [m, c, H] hidden states are kept for
    backward (SmolLM2 has 49,152 logits per token against 576 hidden values): no [m, R, vocab]
    tensor ever exists. The log-probs are float32 whatever the model's dtype. This needs the
    output layer to be a plain map of the last hidden state (`check_logprobs`).

    `widths` (widest prompt, widest response, shortest prompt), ints known on the host
    (`GroupBatch.host_lengths`): the columns to keep, and whether the prompts need padding
    (`prompt_attention_mask`); None: read from the tensors (three host syncs on a GPU).
    """
    if widths is None:
        prompt_len = prompt_mask.sum(-1)                                       # [n]
        widths = int(prompt_len.max()), int(response_len.max()), int(prompt_len.min())
    width, r, shortest = widths    # columns of padding only, in prompts and responses, dropped
    response_ids = response_ids[:, :r]                                         # [m, R']
    prompt_ids, prompt_mask = prompt_ids[:, -width:], prompt_mask[:, -width:]  # [n, P']
    layers = [PromptRecorder() for _ in range(model.config.num_hidden_layers)]
    prompt = model.base_model(input_ids=prompt_ids,
                              attention_mask=prompt_attention_mask(model, prompt_mask,
                                                                   padded=shortest < width),
                              position_ids=(prompt_mask.cumsum(-1) - 1).clamp(min=0),
                              past_key_values=cache_of(layers), use_cache=True)
    cache = cache_of([PromptReader(layer.keys[owner], layer.values[owner])    # [m, heads, P', d]
                      for layer in layers])
    positions = torch.arange(r, device=response_ids.device)                   # [R']
    response_mask = (positions < response_len[:, None]).long()                 # [m, R']
    hidden = model.base_model(
        input_ids=response_ids, attention_mask=torch.cat([prompt_mask[owner], response_mask], -1),
        position_ids=prompt_mask.sum(-1)[owner, None] + positions,            # [m, R']
        past_key_values=cache, use_cache=False).last_hidden_state              # [m, R', H]
    # Token j is predicted by the hidden state before it: the prompt's last one for j = 0.
    hidden = torch.cat([prompt.last_hidden_state[owner, -1:], hidden[:, :-1]], 1)   # [m, R', H]
    head = model.get_output_embeddings()
    total = torch.zeros(len(owner), device=response_ids.device, dtype=torch.float32)
    for s in range(0, r, chunk_size):
        args = (head, hidden[:, s:s + chunk_size], response_ids[:, s:s + chunk_size], temperature)
        if torch.is_grad_enabled():        # recompute this chunk's logits during backward
            token_logp = checkpoint(token_logprobs, *args, use_reentrant=False)   # [m, c]
        else:
            token_logp = token_logprobs(*args)                                 # [m, c]
        total = total + (token_logp * response_mask[:, s:s + chunk_size]).sum(-1)
    return total                                                               # [m]


def group_logprobs(model, batch: GroupBatch, temperature=1.0, groups=slice(None),
                   completions=slice(None), lengths=None):
    """`completion_logprobs` of a GroupBatch's groups `groups`, or of the slice `completions` of
    their completions taken group by group (group 0's K, group 1's K, ...), each prompt computed
    once. Only the completions in `batch.keep` are computed (a group drawn short is padded):
    the others get 0 and cost nothing. Which ones those are, and how wide the kept prompts and
    responses are, is decided on the host from `lengths` (`batch.host_lengths()`, which costs
    one transfer from a GPU when not given), so that nothing here waits for the device.
    -> [n·K], or [m] for a slice: `.view(n, K)` recovers the groups of a whole batch"""
    response_len, prompt_len = lengths or batch.host_lengths()     # [B][K], [B] lists of ints
    response_ids = batch.response_ids[groups]                                  # [n, K, R]
    n, k, _ = response_ids.shape
    device = response_ids.device
    owners = [g for g in range(n) for _ in range(k)][completions]              # m, on the host
    lens = [n_tokens for row in response_len[groups] for n_tokens in row][completions]
    kept = [i for i, n_tokens in enumerate(lens) if n_tokens]     # a padded slot has length 0
    if not kept:
        return torch.zeros(len(owners), device=device)
    first, last = owners[kept[0]], owners[kept[-1]] + 1           # the prompts it continues
    continued = prompt_len[groups][first:last]
    widths = (max(continued), max(lens[i] for i in kept), min(continued))
    owner = torch.arange(n, device=device).repeat_interleave(k)[completions]  # [m]
    chosen = slice(None) if len(kept) == len(owners) else index_on(kept, device)
    logp = completion_logprobs(
        model, batch.prompt_ids[groups][first:last], batch.prompt_mask[groups][first:last],
        response_ids.flatten(0, 1)[completions][chosen],
        batch.response_len[groups].flatten()[completions][chosen], owner[chosen] - first,
        temperature, widths=widths)                                            # [kept]
    if len(kept) == len(owners):
        return logp
    return torch.zeros(len(owners), device=device, dtype=logp.dtype).index_copy(0, chosen, logp)


def index_on(indices, device):
    """A list of ints as an index tensor on `device`, copied without making the host wait."""
    index = torch.tensor(indices, dtype=torch.long)
    if torch.device(device).type == "cuda":
        return index.pin_memory().to(device, non_blocking=True)
    return index.to(device)


def check_logprobs(model):
    """`completion_logprobs` applies the output layer to the decoder's hidden states itself, and
    runs completions against a prompt cache of its own. Check, once at load time, that both
    give the model's own numbers: a model that post-processes its logits (soft-capping, scaling)
    or caches differently would be trained on another distribution than it samples."""
    device = next(model.parameters()).device
    vocab = model.get_output_embeddings().out_features
    prompt_ids = torch.tensor([[1, 2, 3], [0, 4, 1]], device=device) % vocab    # [2, 3]
    prompt_mask = torch.tensor([[1, 1, 1], [0, 1, 1]], device=device)            # [2, 3]
    response_ids = torch.tensor([[2, 4], [3, 1], [4, 2]], device=device) % vocab  # [3, 2]
    response_len, owner = torch.tensor([2, 1, 2], device=device), torch.tensor([0, 0, 1], device=device)
    with torch.no_grad():
        own_logits = model(input_ids=prompt_ids[:1], use_cache=False).logits
        head_logits = model.get_output_embeddings()(model.base_model(prompt_ids[:1]).last_hidden_state)
        if not torch.allclose(own_logits.float(), head_logits.float(), rtol=1e-3, atol=1e-3):
            raise ValueError(f"{type(model).__name__} post-processes its output layer's logits "
                             "(e.g. soft-capping), which tba's memory-saving log-probs do not "
                             "reproduce: use a model whose logits are lm_head(last hidden state)")
        ours = completion_logprobs(model, prompt_ids, prompt_mask, response_ids, response_len, owner)
        own = []
        for i, p in enumerate(owner.tolist()):        # each sequence alone, no padding at all
            prompt = prompt_ids[p][prompt_mask[p].bool()]
            ids = torch.cat([prompt, response_ids[i, :response_len[i]]])[None]
            logp = model(input_ids=ids, use_cache=False).logits.float().log_softmax(-1)[0]
            own.append(logp[len(prompt) - 1:-1].gather(-1, ids[0, len(prompt):, None]).sum())
    if not torch.allclose(ours, torch.stack(own), rtol=1e-3, atol=1e-3):
        raise ValueError(f"{type(model).__name__}'s own log-probs differ from those tba computes "
                         "with each prompt's keys and values shared by its completions (its "
                         "layers may cache differently, e.g. a sliding window): use a model such "
                         "as a Llama, Qwen or GPT-2")


def enable_activation_checkpointing(model):
    """Keep only each decoder layer's input for backward and recompute the layer's activations
    then: about a third more compute for a fraction of the memory. Done here rather than with
    HF's switch, which only works in training mode (dropout on) and drops the cache of a
    checkpointed layer, since recomputing a layer that appends to its cache would append twice;
    `completion_logprobs`'s caches are safe to recompute (`PromptRecorder`, `PromptReader`)."""
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    for layer in layers:
        layer.forward = functools.partial(checkpointed, layer.forward)
    model.checkpointed_layers = len(layers)


def checkpointed(forward, *args, **kwargs):
    """A layer's forward under activation checkpointing, when a backward pass will follow."""
    if torch.is_grad_enabled():
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return forward(*args, **kwargs)
