"""The trainer: the sequence log-probs, the trajectory-balance loss, one optimiser step.

Everything here works on *groups*: B prompts with K completions each, so every per-trajectory
tensor is shaped [B, K]. The batch layout is `batch.GroupBatch`, whether it comes straight from
the synchronous loop or from the replay buffer. Seams: the log-probs of a step come from
`logprobs.group_logprobs` (the fast path, equal to `sequence_logprobs`); a `--loss` other than tb
is a `Loss` that options/losses.py builds.
"""
import math
from dataclasses import dataclass
from typing import Callable

import torch

from llm import precision
from batch import GroupBatch
from devices.memory import groups_per_pass
from plumbing.errors import NonFiniteError
from llm.logprobs import group_logprobs
from plumbing import staleness


def sequence_logprobs(model, batch: GroupBatch, temperature=1.0):
    """What the trainer's log-probs are, the plain way: for every completion, its prompt and
    response as one sequence without padding through the model's forward, then the sum over the
    response tokens of log p(token | everything before it), at `temperature`.    -> [B·K]
    (`logprobs.group_logprobs` computes the same numbers for a fraction of the time and memory.)"""
    totals = []
    for b in range(batch.reward.shape[0]):
        prompt = batch.prompt_ids[b][batch.prompt_mask[b].bool()]                     # [p]
        for k in range(batch.reward.shape[1]):
            ids = torch.cat([prompt, batch.response_ids[b, k, :batch.response_len[b, k]]])  # [p+r]
            logits = model(input_ids=ids[None], use_cache=False).logits[0, :-1]      # [p+r-1, V]
            token_logp = (logits.float() / temperature).log_softmax(-1).gather(
                -1, ids[1:, None]).squeeze(-1)                                        # [p+r-1]
            totals.append(token_logp[len(prompt) - 1:].sum())                         # response
    return torch.stack(totals)


def tb_loss(logp, ref_logp, reward, beta, keep=None, log_z=None):
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
    fewer than K is padded), the means taken over them. `log_z` [B]: a learned log Z of each
    group's prompt (options/learned_log_z.py), trained by this loss too, used instead of log Ẑ
    (NaN entries: not learned yet, log Ẑ instead). Returns (loss, log_z [B]).
    """
    keep = torch.ones_like(logp, dtype=torch.bool) if keep is None else keep    # [B, K]
    n = keep.sum(1)                                             # [B]
    delta = torch.where(keep, logp - ref_logp - reward / beta, 0.0)             # [B, K]
    estimate = -(delta.sum(1) / n).detach()                     # [B]
    log_z = estimate if log_z is None else torch.where(log_z.isnan(), estimate, log_z)
    loss = (torch.where(keep, log_z[:, None] + delta, 0.0).pow(2).sum(1) / n).mean()  # []
    return loss, log_z.detach()


# logged where known: staleness.diagnostics and the gradient sketch
DIAGNOSTICS = ("log_ratio_rewarded", "log_ratio_unrewarded", "low_ratio_share", "grad_cos_prev")


@dataclass(frozen=True)
class Loss:
    """What a step minimises: `fn`(logp, ref_logp, reward, beta, **inputs) -> loss or
    (loss, log_z), all [B, K] but the scalar β. Options plug in here (options/losses.py, one per
    --loss): `inputs`(logp [n, K], batch, part, version) -> what else `fn` reads of groups
    `part`; `ess_step`: the step's learning rate times √(ESS/N) of the weights π/μ (VCPO)."""
    fn: Callable
    inputs: Callable | None = None
    ess_step: bool = False


TB = Loss(tb_loss)             # the plain one, and the default


def train_step(model, optimizer, scheduler, batch: GroupBatch, *, beta, loss=None, temperature=1.0,
               micro_groups=None, max_grad_norm=None, micro_completions=0,
               dtype=torch.float32, scaler=None, reward_temp=1.0, learned_log_z=None,
               version=None):
    """One optimiser step on B groups, accumulating gradients over micro-batches of whole groups
    (`micro_groups`: each log Ẑ stays the mean over its own K, so the sum is the full batch's
    gradient exactly; `micro_completions` splits further, see `backward_micro_batch`).
    Forward passes run under autocast to `dtype` over float32 weights; `scaler` scales float16
    losses. The model stays in eval mode: dropout would make the trained log-probs differ from
    the sampled ones. A NaN or infinite loss or gradient raises NonFiniteError *before* the
    update: one such step would turn every weight, and every searcher's samples, into NaN.
    tb only: `reward_temp` τ tempers the target to (p_ref·exp(r/β))^(1/τ) (log p_ref and r
    divided by τ); `learned_log_z` (learned_log_z.LearnedLogZ) replaces the group estimate of
    log Z and takes its own step with the policy's. `loss`: a `Loss` (None: TB). `version`: the
    updates the policy has had (a group sampled by that version is fresh: `staleness.log_ratio`).

    Host work is what a small model on a GPU waits for, so the step reads the device once: the
    shapes of every pass are decided from the batch's lengths before it moves (`host_lengths`),
    the batch moves without blocking, one autocast context spans the step (each weight is cast
    once, not once a pass), and every statistic, the loss and the gradient norm come back
    together in one transfer, before the update (bench/overhead.py counts it)."""
    device = next(model.parameters()).device
    loss = loss or TB
    scaler = scaler or torch.amp.GradScaler(device.type, enabled=False)
    micro_groups = micro_groups or groups_per_pass(model, optimizer, batch, dtype)
    lengths = batch.host_lengths()                 # on the host already, or one transfer
    batch = batch.to(device, non_blocking=True)
    b = batch.reward.shape[0]
    optimizer.zero_grad(set_to_none=True)
    if learned_log_z is not None:
        learned_log_z.zero_grad(set_to_none=True)
    total_loss, logps, log_zs = 0.0, [], []
    with precision.autocast(device, dtype):           # forward passes only: see backward_micro_batch
        for start in range(0, b, micro_groups or b):
            part = slice(start, min(start + (micro_groups or b), b))
            part_loss, logp, log_z = backward_micro_batch(
                model, batch, part, loss=loss, beta=beta, temperature=temperature,
                micro_completions=micro_completions, dtype=dtype, scaler=scaler,
                reward_temp=reward_temp, learned_log_z=learned_log_z, lengths=lengths,
                version=version)
            total_loss = total_loss + part_loss                                # []
            logps.append(logp)                                                 # [n, K]
            if log_z is not None:
                log_zs.append(log_z)                                           # [n]
    logp, kept = torch.cat(logps), batch.kept()                                # [B, K], [B, K]
    stats = step_stats(logp, batch, kept)                                      # 0-dim tensors
    if log_zs:                                                                 # RLOO has none
        stats["log_z"] = torch.cat(log_zs).float().mean()
    if batch.behaviour_logp is not None:
        stats.update(staleness.off_policy_stats(logp, batch.behaviour_logp, batch.keep))
        if loss.ess_step:   # a completion sampled by these very weights has π/μ = 1 exactly
            rho = staleness.log_ratio(logp, batch.behaviour_logp, batch.version, version)
            stats["step_ess_frac"] = staleness.off_policy_stats(rho, torch.zeros_like(rho),
                                                                batch.keep)["ess_frac"]
        # why stale data may hurt
        stats.update(staleness.diagnostics(logp, batch, kept, torch.cat(log_zs) if log_zs
                                          else None, beta))
    grad_norm = clip_gradient(model, optimizer, scaler, max_grad_norm)         # []
    if not hasattr(optimizer, "gradient_sketch"):    # the run's, checkpointed with it (run.state)
        optimizer.gradient_sketch = staleness.GradientSketch(model)
    stats["grad_cos_prev"] = optimizer.gradient_sketch.cosine()
    names = ["loss", "grad_norm", *stats]
    values = torch.stack([torch.as_tensor(total_loss, device=device, dtype=torch.float32),
                          grad_norm.float(), *(v.float() for v in stats.values())])
    host = dict(zip(names, values.tolist()))       # the step's one read of the device
    off_policy = {k: host.pop(k) for k in ("log_ratio_mean", "ess_frac") if k in host}
    if not host.pop("recorded", 0):           # no completion with a recorded log μ: no figures
        off_policy = {}
    elif not math.isfinite(off_policy["ess_frac"]):
        optimizer.zero_grad(set_to_none=True)
        raise NonFiniteError(f"ESS/N of the batch's weights π/μ is {off_policy['ess_frac']:.4g} "
                             f"(mean log π/μ {off_policy['log_ratio_mean']:.4g}); the update was "
                             f"not applied")
    step_ess = host.pop("step_ess_frac", math.nan)
    lr_scale = (staleness.ess_step_scale({"ess_frac": step_ess} if off_policy else {})
                if loss.ess_step else 1.0)
    loss_scale = (scaler.get_scale() if scaler.is_enabled() and learned_log_z is not None
                  else 1.0)                                  # read before the scaler moves it
    apply_update(optimizer, scheduler, scaler, total_loss=host["loss"],
                 grad_norm=host["grad_norm"], lr_scale=lr_scale)
    if learned_log_z is not None:   # unscaled, and skipped with the policy's on an overflow
        learned_log_z.step(loss_scale, skip=not math.isfinite(host["grad_norm"]))
    return {
        "loss": host["loss"],
        "log_z": host.get("log_z"),                                     # RLOO has no log Z
        "kl": host["kl"],
        "reward_mean": host["reward_mean"],
        # what may move before learning falls: how sure the policy is of its own samples (the
        # mean sequence log π, an entropy estimate), how long they are, how many groups teach
        # RLOO nothing (every reward equal: TB still learns the KL part from them)
        "logp_mean": host["logp_mean"],
        "response_len_mean": host["response_len_mean"],
        "equal_reward_frac": host["equal_reward_frac"],
        "grad_norm": host["grad_norm"],
        **off_policy,
        **{k: host[k] for k in DIAGNOSTICS if not math.isnan(host.get(k, math.nan))},
        **({"lr_scale": lr_scale} if loss.ess_step else {}),
        **({"grad_scale": scaler.get_scale()} if scaler.is_enabled() else {}),
    }


def step_stats(logp, batch, kept):
    """The step's statistics over the kept completions, as 0-dim tensors on the device, so that
    they are read with the loss in one transfer. logp, kept: [B, K]              -> dict"""
    n = kept.sum()                                                             # []

    def mean(x):                                                               # [B, K] -> []
        return torch.where(kept, x, 0).sum() / n
    return {"kl": mean(logp - batch.ref_logp), "reward_mean": mean(batch.reward),
            "logp_mean": mean(logp), "response_len_mean": mean(batch.response_len.float()),
            "equal_reward_frac": equal_reward_frac(batch.reward, kept)}


def equal_reward_frac(reward, kept):
    """The share of groups whose kept completions all have one reward.
    reward: [B, K] float; kept: [B, K] bool                                     -> [] tensor"""
    highest = torch.where(kept, reward, -math.inf).amax(1)                     # [B]
    lowest = torch.where(kept, reward, math.inf).amin(1)                       # [B]
    return (highest == lowest).float().mean()


def backward_micro_batch(model, batch, part, *, loss, beta, temperature,
                         micro_completions, dtype, scaler, reward_temp=1.0, learned_log_z=None,
                         lengths=None, version=None):
    """Add the gradient of groups `part`, weighted by their share of the batch, to the model's.
    With `micro_completions` m < n·K, a no-grad pass scores all n·K, then each gradient pass
    takes m of them with the others held at their no-grad values: since ∇L = Σ_i ∂L/∂logp_i ·
    ∇logp_i with every ∂L/∂logp_i taken at the same point, the passes add up to the whole
    gradient, for a memory that no longer grows with K. Called inside the step's autocast
    context (forward passes in `dtype`); each backward pass runs with autocast off, as torch
    advises, without leaving the context, whose cast weights serve every pass of the step.
    `lengths`: `batch.host_lengths()`.
    -> (their share of the loss (a 0-dim tensor), their log-probs [n, K] (detached),
        their log Ẑ [n] or None)"""
    device = next(model.parameters()).device
    b, k = batch.reward.shape
    n = part.stop - part.start
    lengths = lengths or batch.host_lengths()
    size = micro_completions if 0 < micro_completions < n * k else n * k
    if size < n * k:
        with torch.no_grad():
            held = group_logprobs(model, batch, temperature, groups=part, lengths=lengths)  # [n·K]
    for s in range(0, n * k, size):
        logp = group_logprobs(model, batch, temperature, groups=part,
                              completions=slice(s, s + size), lengths=lengths)  # [size]
        if size < n * k:
            logp = torch.cat([held[:s], logp, held[s + size:]])                 # [n·K]
        extra = loss.inputs(logp.view(n, k), batch, part, version) if loss.inputs else {}
        if batch.keep is not None:
            extra["keep"] = batch.keep[part]
        if learned_log_z is not None:     # its gradient taken once, in the first pass
            log_z = learned_log_z(batch.prompt_index[part])                      # [n]
            extra["log_z"] = log_z if s == 0 else log_z.detach()
        out = loss.fn(logp.view(n, k), batch.ref_logp[part] / reward_temp,
                      batch.reward[part] / reward_temp, beta, **extra)
        part_loss, log_z = out if isinstance(out, tuple) else (out, None)
        if learned_log_z is not None:
            learned_log_z.first_seen(batch.prompt_index[part], log_z)
        if part_loss.requires_grad:     # False: this pass held only padding
            with torch.autocast(device.type, enabled=False):
                scaler.scale(part_loss * n / b).backward()
    return part_loss.detach() * n / b, logp.detach().view(n, k), log_z


def clip_gradient(model, optimizer, scaler, max_grad_norm):
    """Unscale (float16) and clip the accumulated gradient.  -> its norm before clipping, [] tensor
    (inf or NaN when not finite: `apply_update` then refuses the step, or the scaler skips it)"""
    scaler.unscale_(optimizer)
    return torch.nn.utils.clip_grad_norm_(model.parameters(),
                                          max_grad_norm if max_grad_norm else math.inf)


def apply_update(optimizer, scheduler, scaler, *, total_loss, grad_norm, lr_scale=1.0):
    """Take the optimiser and schedule steps on the clipped gradient (`clip_gradient`), unless the
    loss or the gradient is not finite (NonFiniteError, nothing applied). The optimiser step is
    taken at the schedule's learning rate times `lr_scale`, the schedule itself left as it was.
    total_loss, grad_norm: floats, read on the host with the step's statistics."""
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
