"""Trajectory balance that knows how far its sampler has moved: corrections for stale data.

TB's fixed point ignores who sampled a completion; its step does not. With the per-prompt log Ẑ
detached, ∇TB = 2·Σ_i (log Ẑ + δ_i)·∇log π(y_i): REINFORCE with a group-mean baseline, each
completion's weight set by the mix of right and wrong answers the *sampler* μ drew, and nothing
in it that slows down as π moves away from μ. Each loss here is TB with one term that does, read
from ρ_i = log π(y_i) − log μ(y_i) (`staleness.log_ratio`); `options/losses.py` registers them:

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
              step of VCPO (arXiv 2602.17616; `staleness.ess_step_scale`): the control that tells a
              loss's effect from a smaller step.
  tb-topr-ess tb-topr with tb-ess's step: stale negatives tapered, positives' pull kept, and
              the step slowed as π leaves the sampler (what VCPO does to RLOO, on TB).

At lag 0 each is exactly TB: ρ is taken as 0 for completions sampled by the very weights being
trained (the version of their group is the step's), where log π and log μ differ by rounding
only (`staleness.log_ratio`). Completions without a recorded log μ (NaN) also count as fresh.
"""
import torch

import trainer


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
