"""The trainer: sequence log-probs, the trajectory-balance and RLOO losses, schedules, one step.

Everything here works on *groups*: B prompts with K completions each, so every per-trajectory
tensor is shaped [B, K]. The batch layout is `buffer.GroupBatch`, whether it comes straight from
the synchronous loop or from the replay buffer.
"""
import math

import torch
from torch.utils.checkpoint import checkpoint

import models
from buffer import GroupBatch


def token_logprobs(head, hidden, targets, temperature):
    """log p(target) at each position from the decoder's last hidden states.      -> [N, c]

    hidden: [N, c, H], targets: [N, c]. Float32 from the logits on, whatever the model's dtype.
    """
    logits = head(hidden).float() / temperature                              # [N, c, V]
    chosen = logits.gather(-1, targets[..., None]).squeeze(-1)               # [N, c]
    return chosen - torch.logsumexp(logits, dim=-1)                          # [N, c]


def sequence_logprobs(model, input_ids, attention_mask, response_mask, temperature=1.0,
                      chunk_size=64):
    """Sum of log p(token) over the response tokens of each sequence.            -> [N]

    input_ids, attention_mask, response_mask: [N, T]. The response mask marks the tokens whose
    log-probs count: the generated ones up to and including the EOS that ended them, never the
    prompt or the padding. Prompts may be left-padded, so position ids are built from the mask;
    otherwise the model would see different positions than it did while generating.

    Memory: the decoder's hidden states go through the output layer `chunk_size` positions at a
    time, and when gradients are on each chunk runs under activation checkpointing, so only the
    [N, c, H] hidden states are kept for backward (SmolLM2 has 49,152 logits per token against
    576 hidden values): no [N, T, vocab] tensor ever exists, and no chunk's logits outlive their
    chunk. The log-probs are float32 whatever the model's dtype. This needs
    the output layer to be a plain map of the last hidden state (`check_output_layer`).
    """
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)        # [N, T]
    first = int(response_mask.float().argmax(-1).min()) if response_mask.any() else 1
    first = max(first, 1)                  # token t is predicted by the hidden state at t - 1
    hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask,
                              position_ids=position_ids, use_cache=False).last_hidden_state
    hidden = hidden[:, first - 1:-1]                                           # [N, T-first, H]
    targets = input_ids[:, first:]                                             # [N, T-first]
    mask = response_mask[:, first:].float()                                   # [N, T-first]
    head = model.get_output_embeddings()
    total = torch.zeros(input_ids.shape[0], device=input_ids.device, dtype=torch.float32)
    for s in range(0, targets.shape[1], chunk_size):
        args = (head, hidden[:, s:s + chunk_size], targets[:, s:s + chunk_size], temperature)
        if torch.is_grad_enabled():        # recompute this chunk's logits during backward
            token_logp = checkpoint(token_logprobs, *args, use_reentrant=False)   # [N, c]
        else:
            token_logp = token_logprobs(*args)                                 # [N, c]
        total = total + (token_logp * mask[:, s:s + chunk_size]).sum(-1)
    return total                                                               # [N]


def check_output_layer(model):
    """`sequence_logprobs` applies the output layer to the decoder's hidden states itself. Check,
    once at load time, that this gives the model's own logits: models that post-process them
    (soft-capping, scaling) would be trained on a different distribution than they sample."""
    ids = torch.tensor([[1, 2, 3, 4]], device=next(model.parameters()).device)
    with torch.no_grad():
        own = model(input_ids=ids, use_cache=False).logits.float()
        ours = model.get_output_embeddings()(model.base_model(input_ids=ids).last_hidden_state)
    if not torch.allclose(own, ours.float(), rtol=1e-3, atol=1e-3):
        raise ValueError(f"{type(model).__name__} post-processes its output layer's logits "
                         "(e.g. soft-capping), which tba's memory-saving log-probs do not "
                         "reproduce: use a model whose logits are lm_head(last hidden state)")


def enable_activation_checkpointing(model):
    """Keep only each decoder layer's input for backward and recompute the layer's activations
    then: about a third more compute for a fraction of the memory. HF checkpoints only in
    training mode, which `train_step` turns on for its passes; training mode would also turn on
    dropout, so a model that has any is refused (SmolLM2 and Llama have none)."""
    dropouts = [f"{name}: p={m.p}" for name, m in model.named_modules()
                if isinstance(m, torch.nn.Dropout) and m.p > 0]
    if getattr(model.config, "attention_dropout", 0):        # Llama-style: not a module
        dropouts.append(f"attention_dropout={model.config.attention_dropout}")
    if dropouts:
        raise ValueError(f"--activation-checkpointing runs the model in training mode, which would "
                         f"turn on its dropout ({', '.join(dropouts)}): set it to 0 in the model's "
                         "config, or train without --activation-checkpointing")
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})


def tb_loss(logp, ref_logp, reward, beta):
    """VarGrad trajectory balance towards p*(y|x) ∝ p_ref(y|x) · exp(r(x, y) / β).

        delta_i  = log p_θ(y_i|x) − log p_ref(y_i|x) − r_i / β
        log Ẑ(x) = −mean_i delta_i                     (detached, one per prompt)
        loss     = mean over prompts and i of (log Ẑ(x) + delta_i)²

    All inputs are [B, K]: row b holds the K completions of prompt b. The loss is zero exactly
    when log p_θ − log p_ref − r/β is constant within each group, i.e. when p_θ ∝ p_ref·exp(r/β)
    on the sampled completions. Any behaviour policy may have produced them: that is why stale
    and replayed data are fine. Returns (loss, log_z [B]).
    """
    delta = logp - ref_logp - reward / beta                     # [B, K]
    log_z = -delta.mean(dim=1).detach()                         # [B]
    loss = (log_z[:, None] + delta).pow(2).mean()               # []
    return loss, log_z


def rloo_loss(logp, ref_logp, reward, beta):
    """On-policy REINFORCE leave-one-out: the baseline TB is compared against.

    The reward is KL-regularised, r − β·(log p_θ − log p_ref), and each completion's baseline is
    the mean of the other K − 1 in its group. Valid only for samples from the current policy.
    """
    k = logp.shape[1]
    kl_reward = (reward - beta * (logp - ref_logp)).detach()                   # [B, K]
    baseline = (kl_reward.sum(1, keepdim=True) - kl_reward) / (k - 1)          # [B, K]
    advantage = kl_reward - baseline                                           # [B, K]
    return -(advantage * logp).mean()


LOSSES = {"tb": tb_loss, "rloo": rloo_loss}


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
    """AdamW with the WSD schedule as a LambdaLR (both go into checkpoints)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, WSD(total_steps, warmup_steps, decay_steps))
    return optimizer, scheduler


def group_inputs(batch: GroupBatch, group_slice=slice(None)):
    """Lay the groups out as model inputs: prompt (left-padded) then response (right-padded).

    Returns input_ids, attention_mask, response_mask, all [n·K, P + R], in the order
    (group 0: completions 0..K-1, group 1: ...), so `.view(n, K)` recovers the groups.
    """
    prompt_ids = batch.prompt_ids[group_slice]                                 # [n, P]
    prompt_mask = batch.prompt_mask[group_slice]                               # [n, P]
    response_ids = batch.response_ids[group_slice]                             # [n, K, R]
    response_len = batch.response_len[group_slice]                             # [n, K]
    n, k, r = response_ids.shape
    positions = torch.arange(r, device=response_ids.device)
    response_mask = (positions < response_len[..., None]).long()               # [n, K, R]
    input_ids = torch.cat([prompt_ids[:, None].expand(n, k, -1), response_ids], -1)
    attention_mask = torch.cat([prompt_mask[:, None].expand(n, k, -1).long(), response_mask], -1)
    response_mask = torch.cat([torch.zeros_like(prompt_mask)[:, None].expand(n, k, -1).long(),
                               response_mask], -1)
    flat = lambda t: t.reshape(n * k, -1)
    return flat(input_ids), flat(attention_mask), flat(response_mask)


class NonFiniteError(ArithmeticError):
    """The loss or the gradient norm of a step is NaN or infinite; the step was not applied."""


def train_step(model, optimizer, scheduler, batch: GroupBatch, *, beta, loss="tb", temperature=1.0,
               micro_groups=None, max_grad_norm=None, micro_completions=0, dtype=torch.float32,
               scaler=None):
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
    The model stays in eval mode: dropout would make the trained log-probs differ from the
    sampled ones. Activation checkpointing is the exception, as HF only runs it in training mode
    (`enable_activation_checkpointing` makes sure the model has no dropout to turn on).
    A NaN or infinite loss or gradient norm raises NonFiniteError *before* the optimiser step:
    one such update would turn every weight into NaN, and the searchers would sample from it.
    """
    device = next(model.parameters()).device
    scaler = scaler or torch.amp.GradScaler(device.type, enabled=False)
    batch = batch.to(device)
    b, k = batch.reward.shape
    micro_groups = micro_groups or b
    loss_fn = LOSSES[loss]
    optimizer.zero_grad(set_to_none=True)
    model.train(model.is_activation_checkpointing)
    total_loss, logps, log_zs = 0.0, [], []
    try:
        for start in range(0, b, micro_groups):
            part = slice(start, min(start + micro_groups, b))
            n = part.stop - part.start
            inputs = group_inputs(batch, part)                                 # 3 × [n·K, T]
            size = micro_completions if 0 < micro_completions < n * k else n * k
            if size < n * k:
                with torch.no_grad(), models.autocast(device, dtype):
                    held = sequence_logprobs(model, *inputs, temperature)     # [n·K]
            for s in range(0, n * k, size):
                with models.autocast(device, dtype):
                    logp = sequence_logprobs(model, *(t[s:s + size] for t in inputs),
                                             temperature)                      # [size]
                if size < n * k:
                    logp = torch.cat([held[:s], logp, held[s + size:]])       # [n·K]
                out = loss_fn(logp.view(n, k), batch.ref_logp[part], batch.reward[part], beta)
                part_loss, log_z = out if isinstance(out, tuple) else (out, None)
                scaler.scale(part_loss * n / b).backward()
            total_loss += part_loss.item() * n / b
            logps.append(logp.detach().view(n, k))
            if log_z is not None:
                log_zs.append(log_z)
    finally:
        model.eval()
    scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(
        model.parameters(), max_grad_norm if max_grad_norm else math.inf)
    overflow = not math.isfinite(grad_norm.item())    # float16: the scaler skips this step
    if not math.isfinite(total_loss) or (overflow and not scaler.is_enabled()):
        optimizer.zero_grad(set_to_none=True)
        raise NonFiniteError(f"the loss is {total_loss:.4g} and the gradient norm "
                             f"{grad_norm.item():.4g}; the update was not applied")
    scaler.step(optimizer)
    scaler.update()
    scheduler.step()
    logp = torch.cat(logps)                                                    # [B, K]
    return {
        "loss": total_loss,
        "log_z": torch.cat(log_zs).mean().item() if log_zs else None,   # RLOO has no log Z
        "kl": (logp - batch.ref_logp).mean().item(),
        "reward_mean": batch.reward.mean().item(),
        "grad_norm": grad_norm.item(),
        **({"grad_scale": scaler.get_scale()} if scaler.is_enabled() else {}),
    }
