"""RLOO, the on-policy baseline TB is compared against, and its off-policy corrections.

`--loss rloo`: REINFORCE with a leave-one-out baseline on the KL-regularised reward;
`--loss rloo-is`: weighted by truncated importance weights min(π/μ, C); `--loss vcpo`: the same
with the step size scaled by the effective sample size (`staleness.ess_step_scale`).
`options/losses.py` turns each into the `trainer.Loss` a step takes.
"""
from dataclasses import dataclass

import torch

from plumbing.flags import POSITIVE, flag


@dataclass
class Settings:
    """RLOO and its corrections (options/rloo.py)"""
    rloo_off_policy: bool = flag(False, "let --loss rloo train on the searchers' stale, replayed "
                                        "or explorative groups, although it is an on-policy loss")
    is_clip: float = flag(2.0, "rloo-is, vcpo: C, the largest importance weight π/μ of a "
                               "completion (slime and verl use 2, TBA-prime 8)", POSITIVE)


def check(cfg):
    """Uncorrected RLOO only on the current policy's samples, unless asked for: one rule for
    every way the data gets off-policy."""
    off_policy = [why for why, on in (
        (f"--searchers {cfg.searchers} trains on stale, replayed groups", cfg.searchers),
        (f"--lag {cfg.lag} trains on groups sampled {cfg.lag} updates earlier", cfg.lag),
        (f"--replay-groups {cfg.replay_groups} trains on replayed groups", cfg.replay_groups),
        ("--search-temperature/--reference-frac sample from other distributions",
         cfg.search_temperature or cfg.reference_frac)) if on]
    if cfg.loss == "rloo" and off_policy and not cfg.rloo_off_policy:
        raise ValueError(f"--loss rloo is on-policy, but {off_policy[0]}: use --loss rloo-is "
                         "(importance-corrected) or --loss tb, or add --rloo-off-policy to "
                         "train it uncorrected anyway")


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
