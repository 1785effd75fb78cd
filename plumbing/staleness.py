"""How stale the data of a step is, and what it does to the step: the statistics a trainer step
logs whichever loss it takes (`trainer.train_step` reads them with the loss, in one transfer).

π is the policy being trained, μ the one that sampled a completion (its log μ recorded by the
searcher); ρ = log π − log μ of each completion, summed over its tokens.
"""
import math

import torch


def log_ratio(logp, behaviour_logp, version, current):
    """ρ = log π − log μ of each completion, 0 where it was sampled by the weights of version
    `current` (the ones being trained: π is μ; None: none is) or has no recorded log μ. The
    gradient flows through log π.
    logp, behaviour_logp: [B, K]; version: [B, K] or [B]                          -> [B, K]"""
    version = version if version.dim() == 2 else version[:, None].expand_as(logp)   # [B, K]
    fresh = behaviour_logp.isnan()                                               # [B, K]
    if current is not None:
        fresh = fresh | (version == current)
    return torch.where(fresh, 0.0, logp - torch.nan_to_num(behaviour_logp))      # [B, K]


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


def diagnostics(logp, batch, kept, log_z, beta):
    """What tells the explanations of TB's trouble with stale data apart, as 0-dim tensors read
    with the step's other statistics (NaN where nothing counts):
    - log_ratio_rewarded / log_ratio_unrewarded: the mean log π/μ of completions rewarded above /
      below their group's mean: how far π has already moved on the samples it learns from;
    - low_ratio_share: the share of the step's per-completion weights |log Ẑ + δ_i| (TB's
      gradient is Σ_i 2·(log Ẑ + δ_i)·∇log π_i) carried by completions with π/μ < e⁻²,
      samples π has all but left.
    logp, kept: [B, K]; log_z: [B] the step's log Ẑ (None: RLOO, no share)     -> dict"""
    rho = logp.detach() - batch.behaviour_logp                                  # [B, K]
    counted = kept & ~rho.isnan()                                               # [B, K]
    group_mean = (torch.where(kept, batch.reward, 0).sum(1, keepdim=True)
                  / kept.sum(1, keepdim=True).clamp(min=1))                     # [B, 1]

    def mean(x, where):
        return torch.where(where, x, 0.0).sum() / where.sum()                  # NaN if none
    stats = {"log_ratio_rewarded": mean(rho, counted & (batch.reward > group_mean)),
             "log_ratio_unrewarded": mean(rho, counted & (batch.reward < group_mean))}
    if log_z is not None:
        residual = (log_z[:, None] + logp.detach() - batch.ref_logp
                    - batch.reward / beta).abs()                                # [B, K]
        stats["low_ratio_share"] = (torch.where(counted & (rho < -2), residual, 0.0).sum()
                                    / torch.where(counted, residual, 0.0).sum())
    return stats


class GradientSketch:
    """The cosine between consecutive steps' gradients, on a fixed random set of `size`
    coordinates (the same every step; a random projection that costs one gather a parameter):
    near 1, steps keep pushing one way; near 0 or below, they undo each other."""

    def __init__(self, model, previous=None, size=1 << 16, seed=0):
        params = [p for p in model.parameters() if p.requires_grad]
        total = sum(p.numel() for p in params)
        g = torch.Generator().manual_seed(seed)
        self.index = [torch.randint(0, p.numel(), (max(1, size * p.numel() // total),),
                                    generator=g).to(p.device) for p in params]
        self.params, self.previous = params, previous          # [size]: the last step's

    def cosine(self):
        """This step's gradient against the last call's.                      -> [] (NaN first)"""
        now = torch.cat([p.grad.flatten()[i].float() if p.grad is not None
                         else torch.zeros(len(i), device=i.device)
                         for p, i in zip(self.params, self.index)])             # [size]
        previous, self.previous = self.previous, now
        if previous is None:
            return torch.tensor(math.nan, device=now.device)
        return torch.nn.functional.cosine_similarity(now, previous.to(now.device), dim=0)
