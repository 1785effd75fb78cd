"""RLOO, the on-policy baseline TB is compared against, and its off-policy corrections.

`--loss rloo`: REINFORCE with a leave-one-out baseline on the KL-regularised reward;
`--loss rloo-is`: weighted by truncated importance weights min(π/μ, C); `--loss vcpo`: the same
with the step size scaled by the effective sample size (`staleness.ess_step_scale`).
`options/losses.py` turns each into the `trainer.Loss` a step takes.
"""
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
