"""The trainer: sequence log-probs, the trajectory-balance and RLOO losses, schedules, one step.

Everything here works on *groups*: B prompts with K completions each, so every per-trajectory
tensor is shaped [B, K]. The batch layout is `buffer.GroupBatch`, whether it comes straight from
the synchronous loop or from the replay buffer.
"""
import ctypes
import ctypes.util
import functools
import math

import torch
from torch.utils.checkpoint import checkpoint
from transformers.cache_utils import DynamicCache, DynamicLayer
from transformers.modeling_layers import GradientCheckpointingLayer

import models
from buffer import GroupBatch


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


def completion_logprobs(model, prompt_ids, prompt_mask, response_ids, response_len, owner,
                        temperature=1.0, chunk_size=64):
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
    """
    r = int(response_len.max())                      # columns of padding only are dropped
    response_ids = response_ids[:, :r]                                         # [m, R']
    width = int(prompt_mask.sum(-1).max())           # as are the prompts' padding-only columns
    prompt_ids, prompt_mask = prompt_ids[:, -width:], prompt_mask[:, -width:]  # [n, P']
    layers = [PromptRecorder() for _ in range(model.config.num_hidden_layers)]
    prompt = model.base_model(input_ids=prompt_ids, attention_mask=prompt_mask,
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
                   completions=slice(None)):
    """`completion_logprobs` of a GroupBatch's groups `groups`, or of the slice `completions` of
    their completions taken group by group (group 0's K, group 1's K, ...), each prompt computed
    once. Only the completions in `batch.keep` are computed (a group drawn short is padded):
    the others get 0 and cost nothing.
    -> [n·K], or [m] for a slice: `.view(n, K)` recovers the groups of a whole batch"""
    response_ids = batch.response_ids[groups]                                  # [n, K, R]
    n, k, _ = response_ids.shape
    owner = torch.arange(n, device=response_ids.device).repeat_interleave(k)[completions]  # [m]
    kept = batch.kept()[groups].flatten()[completions]                         # [m]
    if not kept.any():
        return torch.zeros(len(owner), device=response_ids.device)
    first, last = int(owner[kept][0]), int(owner[kept][-1]) + 1  # the prompts it continues
    logp = completion_logprobs(
        model, batch.prompt_ids[groups][first:last], batch.prompt_mask[groups][first:last],
        response_ids.flatten(0, 1)[completions][kept],
        batch.response_len[groups].flatten()[completions][kept], owner[kept] - first,
        temperature)                                                           # [kept]
    if kept.all():
        return logp
    return torch.zeros(len(owner), device=logp.device).masked_scatter(kept, logp)   # [m]


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


def tb_loss(logp, ref_logp, reward, beta, keep=None):
    """VarGrad trajectory balance towards p*(y|x) ∝ p_ref(y|x) · exp(r(x, y) / β).

        delta_i  = log p_θ(y_i|x) − log p_ref(y_i|x) − r_i / β
        log Ẑ(x) = −mean_i delta_i                     (detached, one per prompt)
        loss     = mean over prompts and i of (log Ẑ(x) + delta_i)²

    All inputs are [B, K]: row b holds the K completions of prompt b. The loss is zero exactly
    when log p_θ − log p_ref − r/β is constant within each group, i.e. when p_θ ∝ p_ref·exp(r/β)
    on the sampled completions. Any behaviour policy may have produced them: that is why stale,
    replayed and explorative data are fine, and why a group may mix completions of different
    weight versions and temperatures, drawn from the buffer long after they were sampled:
    log Ẑ is fitted to whichever completions meet in a group, and the fixed point, every
    residual log p_θ − log p_ref − r/β equal to one constant per prompt, does not depend on
    which ones meet. `keep` [B, K] bool: only these completions count (a group drawn with
    fewer than K is padded), the means taken over them. Returns (loss, log_z [B]).
    """
    keep = torch.ones_like(logp, dtype=torch.bool) if keep is None else keep    # [B, K]
    n = keep.sum(1)                                             # [B]
    delta = torch.where(keep, logp - ref_logp - reward / beta, 0.0)             # [B, K]
    log_z = -(delta.sum(1) / n).detach()                        # [B]
    loss = (torch.where(keep, log_z[:, None] + delta, 0.0).pow(2).sum(1) / n).mean()  # []
    return loss, log_z


def rloo_loss(logp, ref_logp, reward, beta, is_weight=None, keep=None):
    """REINFORCE leave-one-out: the baseline TB is compared against.

    The reward is KL-regularised, r − β·(log p_θ − log p_ref), and each completion's baseline is
    the mean of the other K − 1 in its group. Unbiased only for samples from the current policy;
    `is_weight` [B, K] (`truncated_is_weights`) reweights samples of another policy μ towards it.
    `keep` [B, K] bool: only these completions count (a group drawn short is padded).
    """
    keep = torch.ones_like(logp, dtype=torch.bool) if keep is None else keep    # [B, K]
    n = keep.sum(1, keepdim=True)                                              # [B, 1]
    kl_reward = torch.where(keep, reward - beta * (logp - ref_logp), 0.0).detach()  # [B, K]
    baseline = (kl_reward.sum(1, keepdim=True) - kl_reward) / (n - 1).clamp(min=1)  # [B, K]
    advantage = torch.where(keep, kl_reward - baseline, 0.0)                   # [B, K]
    weight = 1.0 if is_weight is None else is_weight.detach()                  # [B, K]
    return -((weight * advantage * logp).sum(1, keepdim=True) / n).mean()


def truncated_is_weights(logp, behaviour_logp, clip):
    """min(π(y|x) / μ(y|x), C) of each completion, the sequence-level truncated importance
    weight of off-policy RLOO (slime, verl): unbiased below C, bounded variance above it.
    logp, behaviour_logp: [B, K] log π and log μ summed over each response.       -> [B, K]"""
    if behaviour_logp is None or behaviour_logp.isnan().any():
        raise ValueError("--loss rloo-is and vcpo need the behaviour log-probs log μ of every "
                         "group, and this batch has none: train it with --loss tb")
    return (logp.detach() - behaviour_logp).exp().clamp(max=clip)             # [B, K]


def off_policy_metrics(logp, behaviour_logp, keep=None):
    """How far the trained data is from the policy being trained, from the sequence log-ratios
    log π/μ of its completions: their mean, and the effective sample size of the weights π/μ
    as a fraction of the completions, ESS/N = (Σw)² / (N·Σw²), 1 when on-policy. Completions
    without a recorded log μ (NaN), or not kept, are left out.
    logp, behaviour_logp: [B, K]; keep: [B, K] bool or None                      -> dict"""
    log_ratio = (logp.detach() - behaviour_logp).flatten()                      # [B·K]
    counted = ~log_ratio.isnan() & (True if keep is None else keep.flatten())   # [B·K]
    log_ratio = log_ratio[counted]                                              # [N]
    if not log_ratio.numel():
        return {}
    # (Σw)² / Σw² in logs, so that large ratios do not overflow
    log_ess = 2 * log_ratio.logsumexp(0) - (2 * log_ratio).logsumexp(0)
    return {"log_ratio_mean": log_ratio.mean().item(),
            "ess_frac": (log_ess.exp() / log_ratio.numel()).item()}


def ess_step_scale(off_policy):
    """VCPO's step size for stale data (Huang et al. 2026, "Stable Asynchrony: Variance-Controlled
    Off-Policy RL for LLMs", arXiv 2602.17616): the learning rate times √(min(1, ESS/N)), from
    the batch's untruncated sequence weights π/μ. Their diagnosis: as data gets stale, a few
    completions carry most of the weight, the gradient estimate is the mean of fewer samples
    than it seems, and its variance grows like N/ESS; AdamW's step should shrink with the
    square root of the batch it effectively saw. Only their first remedy: their second, a
    baseline weighted by each completion's gradient norm, needs one backward pass per completion.
    off_policy: `off_policy_metrics` of the batch (no "ess_frac": nothing recorded, scale 1)."""
    return math.sqrt(min(1.0, off_policy.get("ess_frac", 1.0)))


LOSSES = {"tb": tb_loss, "rloo": rloo_loss, "rloo-is": rloo_loss, "vcpo": rloo_loss}


def beta_at(step, beta, beta_final, beta_steps):
    """β annealed linearly from `beta` to `beta_final` over `beta_steps` steps, then held."""
    if beta_steps <= 0:
        return beta_final
    frac = min(step / beta_steps, 1.0)
    return beta + frac * (beta_final - beta)


class WSD:
    """Warmup-stable-decay learning-rate multiplier: linear up, flat, linear down to zero.

    A callable object rather than a function, so that the scheduler's state dict (and with it a
    checkpoint) carries the schedule's length: a resumed run that goes on past its first
    --steps continues at the decayed rate instead of jumping back up."""

    def __init__(self, total_steps, warmup_steps, decay_steps):
        self.total_steps, self.warmup_steps, self.decay_steps = total_steps, warmup_steps, decay_steps

    def __call__(self, step):
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        decay_start = self.total_steps - self.decay_steps
        if self.decay_steps > 0 and step >= decay_start:
            return max(0.0, (self.total_steps - step) / self.decay_steps)
        return 1.0


def make_optimizer(model, lr, total_steps, warmup_steps, decay_steps, weight_decay=0.0):
    """AdamW with the WSD schedule as a LambdaLR (both go into checkpoints). The fused AdamW
    updates every parameter in one kernel: on 2 CPU cores 0.09 s a step for SmolLM2-135M against
    0.6 s for the loop over its tensors (bench/README.md)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, WSD(total_steps, warmup_steps, decay_steps))
    return optimizer, scheduler


class NonFiniteError(ArithmeticError):
    """The loss or the gradient norm of a step is NaN or infinite; the step was not applied."""


def train_step(model, optimizer, scheduler, batch: GroupBatch, *, beta, loss="tb", is_clip=2.0,
               temperature=1.0, micro_groups=None, max_grad_norm=None, micro_completions=0,
               dtype=torch.float32, scaler=None):
    """One optimiser step on B groups, accumulating gradients over micro-batches.

    Micro-batches of whole groups (`micro_groups`) keep each log Ẑ a mean over its own K
    completions, so the accumulated gradient equals the gradient of the full-batch loss exactly.
    A micro-batch larger than `micro_completions` sequences is split further: a no-grad pass
    scores all its completions, then each gradient pass takes `micro_completions` of them with
    the others held at their no-grad values. Since ∇θ L = Σ_i ∂L/∂logp_i · ∇θ logp_i and every
    ∂L/∂logp_i is taken at the same point, the passes add up to the whole-group gradient: one
    extra forward pass buys a memory that no longer grows with K.
    Forward passes run under autocast to `dtype` over the float32 weights (see `models.autocast`);
    `scaler` (a GradScaler) scales float16 losses, whose small gradients would underflow.
    `loss` "rloo-is" weights RLOO by min(π/μ, `is_clip`) from the batch's behaviour log-probs;
    "vcpo" does the same and scales this step's learning rate by `ess_step_scale`.
    The model stays in eval mode: dropout would make the trained log-probs differ from the
    sampled ones.
    A NaN or infinite loss or gradient norm raises NonFiniteError *before* the optimiser step:
    one such update would turn every weight into NaN, and the searchers would sample from it.
    """
    device = next(model.parameters()).device
    scaler = scaler or torch.amp.GradScaler(device.type, enabled=False)
    batch = batch.to(device)
    b = batch.reward.shape[0]
    optimizer.zero_grad(set_to_none=True)
    total_loss, logps, log_zs = 0.0, [], []
    for start in range(0, b, micro_groups or b):
        part = slice(start, min(start + (micro_groups or b), b))
        part_loss, logp, log_z = backward_micro_batch(
            model, batch, part, loss=loss, beta=beta, is_clip=is_clip, temperature=temperature,
            micro_completions=micro_completions, dtype=dtype, scaler=scaler)
        total_loss += part_loss
        logps.append(logp)                                                     # [n, K]
        if log_z is not None:
            log_zs.append(log_z)                                               # [n]
    logp, kept = torch.cat(logps), batch.kept()                                # [B, K], [B, K]
    off_policy = (off_policy_metrics(logp, batch.behaviour_logp, batch.keep)
                  if batch.behaviour_logp is not None else {})
    lr_scale = ess_step_scale(off_policy) if loss == "vcpo" else 1.0
    grad_norm = apply_update(model, optimizer, scheduler, scaler, total_loss=total_loss,
                             max_grad_norm=max_grad_norm, lr_scale=lr_scale)
    if device.type == "cpu":            # a GPU's activations are not on the heap
        give_back_freed_memory()
    return {
        "loss": total_loss,
        "log_z": torch.cat(log_zs).mean().item() if log_zs else None,   # RLOO has no log Z
        "kl": (logp - batch.ref_logp)[kept].mean().item(),
        "reward_mean": batch.reward[kept].mean().item(),
        # what may move before learning falls: how sure the policy is of its own samples (the
        # mean sequence log π, an entropy estimate), how long they are, how many groups teach
        # RLOO nothing (every reward equal: TB still learns the KL part from them)
        "logp_mean": logp[kept].mean().item(),
        "response_len_mean": batch.response_len[kept].float().mean().item(),
        "equal_reward_frac": equal_reward_frac(batch.reward, kept),
        "grad_norm": grad_norm,
        **off_policy,
        **({"lr_scale": lr_scale} if loss == "vcpo" else {}),
        **({"grad_scale": scaler.get_scale()} if scaler.is_enabled() else {}),
    }


def equal_reward_frac(reward, kept):
    """The share of groups whose kept completions all have one reward.
    reward: [B, K] float; kept: [B, K] bool                                          -> float"""
    highest = torch.where(kept, reward, -math.inf).amax(1)                     # [B]
    lowest = torch.where(kept, reward, math.inf).amin(1)                       # [B]
    return (highest == lowest).float().mean().item()


def backward_micro_batch(model, batch, part, *, loss, beta, is_clip, temperature,
                         micro_completions, dtype, scaler):
    """Add the gradient of groups `part` of the batch, weighted by their share of it, to the
    model's gradients (in passes of at most `micro_completions` completions, see `train_step`).
    -> (their share of the loss, their log-probs [n, K] (detached), their log Ẑ [n] or None)"""
    device = next(model.parameters()).device
    b, k = batch.reward.shape
    n = part.stop - part.start
    size = micro_completions if 0 < micro_completions < n * k else n * k
    if size < n * k:
        with torch.no_grad(), models.autocast(device, dtype):
            held = group_logprobs(model, batch, temperature, groups=part)      # [n·K]
    for s in range(0, n * k, size):
        with models.autocast(device, dtype):
            logp = group_logprobs(model, batch, temperature, groups=part,
                                  completions=slice(s, s + size))              # [size]
        if size < n * k:
            logp = torch.cat([held[:s], logp, held[s + size:]])                 # [n·K]
        extra = {} if batch.keep is None else {"keep": batch.keep[part]}
        if loss in ("rloo-is", "vcpo"):
            extra["is_weight"] = truncated_is_weights(
                logp.view(n, k), batch.behaviour_logp[part], is_clip)          # [n, K]
        out = LOSSES[loss](logp.view(n, k), batch.ref_logp[part], batch.reward[part], beta,
                           **extra)
        part_loss, log_z = out if isinstance(out, tuple) else (out, None)
        if part_loss.requires_grad:     # False: this pass held only padding
            scaler.scale(part_loss * n / b).backward()
    return part_loss.item() * n / b, logp.detach().view(n, k), log_z


LIBC = ctypes.CDLL(ctypes.util.find_library("c"))


def give_back_freed_memory():
    """Hand the heap that the step's activations freed back to the system. glibc keeps freed
    memory for reuse: ~1.9 GiB after an arith step, resident in the trainer between steps while
    the searchers need memory too; asking for it again costs the next step no measurable time
    (bench/memory.py arith). Without glibc (macOS, musl) there is no malloc_trim: nothing done."""
    if hasattr(LIBC, "malloc_trim"):
        LIBC.malloc_trim(0)


def apply_update(model, optimizer, scheduler, scaler, *, total_loss, max_grad_norm, lr_scale=1.0):
    """Clip the accumulated gradient and take the optimiser and schedule steps, unless the loss
    or the gradient is not finite (NonFiniteError, nothing applied). The optimiser step is taken
    at the schedule's learning rate times `lr_scale`, the schedule itself left as it was.
    -> the norm before clipping"""
    scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(
        model.parameters(), max_grad_norm if max_grad_norm else math.inf).item()
    overflow = not math.isfinite(grad_norm)           # float16: the scaler skips this step
    if not math.isfinite(total_loss) or (overflow and not scaler.is_enabled()):
        optimizer.zero_grad(set_to_none=True)
        raise NonFiniteError(f"the loss is {total_loss:.4g} and the gradient norm "
                             f"{grad_norm:.4g}; the update was not applied")
    scheduled_lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] *= lr_scale
    scaler.step(optimizer)
    for group, lr in zip(optimizer.param_groups, scheduled_lrs):
        group["lr"] = lr
    scaler.update()
    scheduler.step()
    return grad_norm
