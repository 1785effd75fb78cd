"""RLOO, the on-policy baseline TB is compared against, and its off-policy corrections.

`--loss rloo`: REINFORCE with a leave-one-out baseline on the KL-regularised reward;
`--loss rloo-is`: weighted by truncated importance weights min(π/μ, C); `--loss vcpo`: the same
with the step size scaled by the effective sample size. `trainer.train_step` calls these through
`trainer.LOSSES` and `off_policy_metrics`.
"""
import math

import torch


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
    stats = off_policy_stats(logp, behaviour_logp, keep)
    values = dict(zip(stats, torch.stack([v.float() for v in stats.values()]).tolist()))
    recorded = values.pop("recorded")                                           # one transfer
    return values if recorded else {}


def off_policy_stats(logp, behaviour_logp, keep=None):
    """`off_policy_metrics` as 0-dim tensors, NaN where no completion counts ("recorded": how
    many do), computed with
    masks rather than by selecting the counted ones: no value is read on the host, so the trainer
    gathers these with its other statistics in one transfer.                -> dict of tensors"""
    log_ratio = logp.detach() - behaviour_logp                                  # [B, K]
    counted = ~log_ratio.isnan() & (True if keep is None else keep)             # [B, K]
    n = counted.sum()                                                           # []
    # (Σw)² / Σw² in logs, so that large ratios do not overflow
    log_ess = (2 * torch.where(counted, log_ratio, -math.inf).logsumexp((0, 1))
               - torch.where(counted, 2 * log_ratio, -math.inf).logsumexp((0, 1)))
    return {"log_ratio_mean": torch.where(counted, log_ratio, 0.0).sum() / n,   # NaN if n = 0
            "ess_frac": log_ess.exp() / n, "recorded": n}


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
