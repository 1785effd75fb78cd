"""The --loss options: each name, the `trainer.Loss` a step takes for it.

A `trainer.Loss` is a loss function and what else it reads (`inputs`: the importance weights
π/μ, or ρ = log π − log μ) and whether the step's learning rate shrinks with ESS/N. TB is the
trainer's own (`trainer.TB`); the others plug in here, built once where the run is assembled
(`assembly.load`), so that the trainer reads no option's name.
"""
import math
from functools import partial

import trainer
from options import stale_tb
from options.rloo import rloo_loss, truncated_is_weights
from plumbing import staleness


def importance_weights(logp, batch, part, version, *, clip):
    """rloo-is, vcpo: min(π/μ, C) of each completion of groups `part`.   logp: [n, K] -> [n, K]"""
    return {"is_weight": truncated_is_weights(logp, batch.behaviour_logp[part], clip)}


def log_ratios(logp, batch, part, version):
    """The TB corrections: ρ of each completion of groups `part`, 0 where fresh.
    logp: [n, K] -> [n, K]"""
    return {"log_ratio": staleness.log_ratio(logp, batch.behaviour_logp[part],
                                             batch.version[part], version)}


# name -> (C, λ) -> trainer.Loss; C: --is-clip, λ: tb-trust's strength (tb-trust:λ)
LOSSES = {
    "tb": lambda clip, strength: trainer.TB,
    "rloo": lambda clip, strength: trainer.Loss(rloo_loss),
    "rloo-is": lambda clip, strength: trainer.Loss(
        rloo_loss, inputs=partial(importance_weights, clip=clip)),
    "vcpo": lambda clip, strength: trainer.Loss(
        rloo_loss, inputs=partial(importance_weights, clip=clip), ess_step=True),
    "tb-trust": lambda clip, strength: trainer.Loss(
        partial(stale_tb.tb_trust_loss, strength=strength), inputs=log_ratios),
    "tb-topr": lambda clip, strength: trainer.Loss(stale_tb.tb_topr_loss, inputs=log_ratios),
    "tb-is": lambda clip, strength: trainer.Loss(stale_tb.tb_is_loss, inputs=log_ratios),
    "tb-ess": lambda clip, strength: trainer.Loss(trainer.tb_loss, ess_step=True),
    "tb-topr-ess": lambda clip, strength: trainer.Loss(stale_tb.tb_topr_loss, inputs=log_ratios,
                                                       ess_step=True),
}


# What each name trains, as --help says it.
HELP = {
    "tb": "trajectory balance, valid off-policy",
    "rloo": "REINFORCE leave-one-out, the on-policy baseline: needs --searchers 0, or "
            "--rloo-off-policy",
    "rloo-is": "RLOO weighted by the truncated importance ratio min(π/μ, --is-clip) of each "
               "completion: the off-policy baseline asynchronous RL trainers ship",
    "vcpo": "rloo-is with each step's learning rate times √(ESS/N) of the weights π/μ, VCPO, "
            "arXiv 2602.17616",
    "tb-trust:λ": "for stale data, like the four below (options/stale_tb.py): a residual with "
                  "λ·(log π − log μ), a trust region towards the sampler; tb-trust is λ 1",
    "tb-topr": "the squared residuals of completions TB pushes down weighted by min(1, π/μ)",
    "tb-is": "every squared residual weighted by min(1, π/μ)",
    "tb-ess": "TB with VCPO's step",
    "tb-topr-ess": "tb-topr with VCPO's step; each of the five is TB at lag 0",
}


def valid(name):
    """--loss: a name of LOSSES, tb-trust with an optional :λ."""
    try:
        return parse(name)[0] in LOSSES
    except ValueError:
        return False


def parse(name):
    """'tb-trust:4' -> ('tb-trust', 4.0); 'tb' -> ('tb', 1.0). ValueError if the parameter is
    not a positive number or the loss takes none."""
    base, _, value = name.partition(":")
    if not value:
        return base, 1.0
    try:
        strength = float(value)
    except ValueError:
        strength = math.nan
    if base != "tb-trust" or not strength > 0 or math.isinf(strength):
        raise ValueError(f"--loss {name}: only tb-trust takes a parameter, a number > 0 "
                         f"(e.g. tb-trust:1)")
    return base, strength


def make(name="tb", is_clip=2.0):
    """The trainer.Loss of --loss `name` ('tb-trust:4' included) with --is-clip `is_clip`."""
    base, strength = parse(name)
    return LOSSES[base](is_clip, strength)
