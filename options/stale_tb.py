"""Trajectory balance that knows how far its sampler has moved: corrections for stale data.

TB's fixed point ignores who sampled a completion; its step does not. With the per-prompt log Ẑ
detached, ∇TB = 2·Σ_i (log Ẑ + δ_i)·∇log π(y_i): REINFORCE with a group-mean baseline, each
completion's weight set by the mix of right and wrong answers the *sampler* μ drew, and nothing
in it that slows down as π moves away from μ. Each loss here is TB with one term that does, read
from ρ_i = log π(y_i) − log μ(y_i) (`log_ratio`); `trainer.LOSSES` registers them:

  tb-trust:λ  a trust region towards the sampler inside the squared residual (relative TB,
              arXiv 2509.01632; Trust-PCL's relative entropy to a lagged policy, arXiv
              1707.01891): residual_i = log Ẑ + δ_i + λ·ρ_i, i.e. `tb_loss` of log π + λ·ρ.
              Its fixed point is π ∝ (p_ref·e^{r/β})^{1/(1+λ)} · μ^{λ/(1+λ)}: a step from the
              sampler towards the target, which becomes the target itself as μ catches up.
              A completion whose log π has already moved by (δ̄ − δ_i)/λ since it was sampled
              stops pushing.
  tb-topr     TOPR's taper (arXiv 2503.14286) on TB's residuals: a completion that the step
              pushes down (residual > 0, TB's "negative" sample) is weighted by min(1, π/μ);
              those pushed up are untouched. Stale negatives that π already left behind
              (π/μ ≪ 1) stop dragging the step. TOPR applies it to rewards below a baseline in
              REINFORCE; here the sign is TB's residual, which is REINFORCE's advantage.
  tb-is       the same taper on every completion, pushed up or down: TB's gradient with
              truncated importance weights min(1, π/μ) (V-trace's c̄ = 1, arXiv 1802.01561;
              `rloo-is` truncates at 2 and uses RLOO's baseline). Samples π has left count
              for little, whichever way the step would move them.
  tb-ess      TB with each step's learning rate times √(min(1, ESS/N)) of the weights π/μ, the
              step of VCPO (arXiv 2602.17616; `rloo.ess_step_scale`): the control that tells a
              loss's effect from a smaller step.
  tb-topr-ess tb-topr with tb-ess's step: stale negatives tapered, positives' pull kept, and
              the step slowed as π leaves the sampler (what VCPO does to RLOO, on TB).

At lag 0 each is exactly TB: ρ is taken as 0 for completions sampled by the very weights being
trained (the version of their group is the step's), where log π and log μ differ by rounding
only (`log_ratio`). Completions without a recorded log μ (NaN) also count as fresh.
"""
import math

import torch

import trainer            # tb_loss, read when called: trainer imports this module


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


def tb_trust_loss(logp, ref_logp, reward, beta, log_ratio, strength=1.0, keep=None, log_z=None):
    """`tb_loss` with residual log Ẑ + δ_i + λ·ρ_i (λ = `strength`, ρ = `log_ratio`).
    -> (loss, log_z)"""
    return trainer.tb_loss(logp + strength * log_ratio, ref_logp, reward, beta, keep=keep,
                           log_z=log_z)


def tapered_tb_loss(logp, ref_logp, reward, beta, taper, keep=None, log_z=None):
    """`tb_loss` with each squared residual weighted by taper(residual) [B, K], which is not
    differentiated; log Ẑ stays the plain group mean.                      -> (loss, log_z)"""
    keep = torch.ones_like(logp, dtype=torch.bool) if keep is None else keep     # [B, K]
    n = keep.sum(1)                                                              # [B]
    delta = torch.where(keep, logp - ref_logp - reward / beta, 0.0)            # [B, K]
    estimate = -(delta.sum(1) / n).detach()                                     # [B], as tb_loss
    log_z = estimate if log_z is None else torch.where(log_z.isnan(), estimate, log_z)
    residual = torch.where(keep, log_z[:, None] + delta, 0.0)                   # [B, K]
    weight = taper(residual.detach())                                           # [B, K]
    return ((weight * residual.pow(2)).sum(1) / n).mean(), log_z.detach()


def tb_topr_loss(logp, ref_logp, reward, beta, log_ratio, keep=None, log_z=None):
    """`tapered_tb_loss` with w_i = min(1, π/μ) where the residual is positive (the step lowers
    log π of that completion), 1 elsewhere.                                -> (loss, log_z)"""
    ratio = log_ratio.detach().clamp(max=0).exp()                               # [B, K]
    return tapered_tb_loss(logp, ref_logp, reward, beta, keep=keep, log_z=log_z,
                           taper=lambda residual: torch.where(residual > 0, ratio, 1.0))


def tb_is_loss(logp, ref_logp, reward, beta, log_ratio, keep=None, log_z=None):
    """`tapered_tb_loss` with w_i = min(1, π/μ) on every completion.       -> (loss, log_z)"""
    ratio = log_ratio.detach().clamp(max=0).exp()                               # [B, K]
    return tapered_tb_loss(logp, ref_logp, reward, beta, keep=keep, log_z=log_z,
                           taper=lambda residual: ratio)


def parse(name):
    """'tb-trust:4' -> ('tb-trust', {'strength': 4.0}); 'tb' -> ('tb', {}). ValueError if the
    parameter is not a positive number or the loss takes none."""
    base, _, value = name.partition(":")
    if not value:
        return base, {}
    try:
        strength = float(value)
    except ValueError:
        strength = math.nan
    if base != "tb-trust" or not strength > 0 or math.isinf(strength):
        raise ValueError(f"--loss {name}: only tb-trust takes a parameter, a number > 0 "
                         f"(e.g. tb-trust:1)")
    return base, {"strength": strength}


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
