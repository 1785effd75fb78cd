"""The schedules of a run: AdamW with the learning rate's warmup-stable-decay schedule, β's and
the reward temperature's linear annealing. All are functions of the step, so a resumed run
continues them exactly. `fit_schedule` fits a task's or a recipe's schedule to a shorter run.
"""
import dataclasses

import torch


def beta_at(step, beta, beta_final, beta_steps):
    """β annealed linearly from `beta` to `beta_final` over `beta_steps` steps, then held."""
    if beta_steps <= 0:
        return beta_final
    frac = min(step / beta_steps, 1.0)
    return beta + frac * (beta_final - beta)


def reward_temp_at(step, reward_temp, reward_temp_steps):
    """The reward temperature τ: `reward_temp` at step 0, linearly down to 1 over
    `reward_temp_steps` steps, then 1 (0 steps: held at `reward_temp`). TB's target is then
    (p_ref·exp(r/β))^(1/τ): flatter early, while the policy still knows little of the reward,
    and exactly p_ref·exp(r/β) once τ reaches 1 (GFlowNet red-teaming: 2 → 1)."""
    if reward_temp_steps <= 0:
        return reward_temp
    return reward_temp + min(step / reward_temp_steps, 1.0) * (1.0 - reward_temp)


class WSD:
    """Warmup-stable-decay learning-rate multiplier: linear up, flat, linear down to `final`
    (0 by default; GFlowNet red-teaming's schedule ends at 0.88: see --lr-final).

    A callable object rather than a function, so that the scheduler's state dict (and with it a
    checkpoint) carries the schedule's length: a resumed run that goes on past its first
    --steps continues at the decayed rate instead of jumping back up."""

    def __init__(self, total_steps, warmup_steps, decay_steps, final=0.0):
        self.total_steps, self.warmup_steps, self.decay_steps = total_steps, warmup_steps, decay_steps
        self.final = final

    def __call__(self, step):
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        decay_start = self.total_steps - self.decay_steps
        if self.decay_steps > 0 and step >= decay_start:
            left = max(0.0, (self.total_steps - step) / self.decay_steps)
            return self.final + (1.0 - self.final) * left
        return 1.0


def make_optimizer(model, lr, total_steps, warmup_steps, decay_steps, weight_decay=0.0,
                   lr_final=0.0):
    """AdamW over the parameters that train (all of them, or a LoRA adapter's) with the WSD
    schedule as a LambdaLR (both go into checkpoints). The fused AdamW updates every parameter
    in one kernel: 0.08 s a step for SmolLM2-135M on 2 CPU cores against 0.22 s before
    (bench/README.md, roofline)."""
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=lr, weight_decay=weight_decay, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, WSD(total_steps, warmup_steps, decay_steps, lr_final))
    return optimizer, scheduler


# --- fitting a task's or a recipe's schedule to the run's --steps ------------------------------
# The learning-rate and β schedules (and the reward temperature's): all must fit in --steps.
SCHEDULE = ("warmup_steps", "decay_steps", "beta_steps", "reward_temp_steps")


def planned_length(planned, recipe_steps, task_steps):
    """The run length a task's or recipe's schedule (`planned`: its SCHEDULE values) was made
    for: the recipe's steps, else the task's, the first that the schedule fits; else the
    shortest run it fits. So a recipe copied with a smaller `steps` and its schedule left as it
    was has that schedule fitted as `--steps` on the command line would fit it."""
    span = max(planned["warmup_steps"] + planned["decay_steps"], planned["beta_steps"],
               planned["reward_temp_steps"] or 0)
    return next((n for n in (recipe_steps, task_steps) if n and n >= span), span)


def fit_schedule(cfg, from_task, task_steps):
    """Warm-up + decay, and β's annealing, must fit in --steps: a trial run shorter than the
    task's (or the recipe's) gets that schedule shrunk in proportion (shown by `describe`); a
    schedule given on the command line that does not fit is refused, not trained silently at a
    fraction of the peak lr. from_task: the SCHEDULE fields the task or the recipe chose;
    task_steps: the run length they were chosen for."""
    def fits(c):
        return (c.warmup_steps + c.decay_steps <= c.steps and c.beta_steps <= c.steps
                and c.reward_temp_steps <= c.steps)
    if fits(cfg):
        return cfg
    scale = cfg.steps / task_steps
    cfg = dataclasses.replace(cfg, **{name: round(getattr(cfg, name) * scale)
                                      for name in SCHEDULE if name in from_task})
    if "reward_temp_steps" in from_task and cfg.reward_temp_steps == 0:
        cfg.reward_temp_steps = 1         # not 0, which would hold τ for the whole run
    if cfg.warmup_steps + cfg.decay_steps > cfg.steps:
        raise ValueError(f"the learning-rate schedule does not fit in --steps {cfg.steps}: "
                         f"--warmup-steps {cfg.warmup_steps} + --decay-steps {cfg.decay_steps} "
                         f"= {cfg.warmup_steps + cfg.decay_steps}: shorten them or train longer")
    if cfg.beta_steps > cfg.steps:
        raise ValueError(f"--beta-steps {cfg.beta_steps} is longer than the run's --steps "
                         f"{cfg.steps}: β would never reach --beta-final; use --beta-steps "
                         f"{cfg.steps} or fewer")
    if cfg.reward_temp_steps > cfg.steps:
        raise ValueError(f"--reward-temp-steps {cfg.reward_temp_steps} is longer than the run's "
                         f"--steps {cfg.steps}: τ would never reach 1; use --reward-temp-steps "
                         f"{cfg.steps} or fewer")
    return cfg


def fitted_note(cfg, fitted, planned, from_recipe):
    """The settings printout's line for a schedule `fit_schedule` shrank: `fitted`, the names it
    changed; `planned`, the values and the run length (`steps`) they were made for."""
    return (f"  fitted to --steps {cfg.steps}: the {'recipe' if from_recipe else 'task'}'s "
            "schedule (" + ", ".join(f"{n.replace('_', '-')} {planned[n]}" for n in fitted)
            + f") is for {planned['steps']} steps")
