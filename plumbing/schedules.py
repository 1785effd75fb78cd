"""The schedules of a run: AdamW with the learning rate's warmup-stable-decay schedule, β's and
the reward temperature's linear annealing. All are functions of the step, so a resumed run
continues them exactly.
"""
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
    in one kernel, not one at a time (its speed: bench/README.md, roofline)."""
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=lr, weight_decay=weight_decay, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, WSD(total_steps, warmup_steps, decay_steps, lr_final))
    return optimizer, scheduler
