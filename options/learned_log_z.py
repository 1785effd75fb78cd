"""--log-z learned: a log Z per prompt, trained with the policy, in place of the group estimate.

Trajectory balance's residual for completion y of prompt x is  log Z(x) + log p_θ(y|x) − log
p_ref(y|x) − r/β. By default (`trainer.tb_loss`) log Z(x) is estimated from the batch: minus the
mean of the other terms over x's K completions, so the loss only asks that they be *equal* within
the group. A group replayed from the buffer is then centred on its own mean: it moves probability
among its K completions, never toward or away from them as a whole. A learned log Z is one number
per prompt that every group of it is measured against: a group whose completions are all better
than the prompt's log Z says pulls their probability up together. At the fixed point both agree:
log Z(x) = log Σ_y p_ref(y|x)·exp(r(x, y)/β), the target's normaliser.

GFlowNet red-teaming learns it as a linear head on the prompt's hidden states; with a fixed set of
prompts (redteam's eight) a table with one entry per prompt is the same thing and needs no
forward pass. An entry starts at the group estimate of the first group of its prompt (the value
the loss would have used), so it does not spend its first hundred steps walking from 0.

It is trained by plain gradient descent on the TB loss, not with the policy's Adam: the loss's
gradient in log Z(x) is 2/B · Σ over x's groups in the batch of their mean residual, so a step
of learning rate lr moves log Z(x) a fraction 2·lr/B of the way to the group's estimate (lr = B/2:
all the way, the group estimate again; lr = B/4: half-way, an average over its recent groups).
Adam's steps of at most ~lr each could not follow the normaliser where it moves by tens of nats,
as it does while the reward temperature anneals.
"""
from dataclasses import dataclass

import torch

from plumbing.flags import POSITIVE, flag, one_of


@dataclass
class Settings:
    """log Z (options/learned_log_z.py)"""
    log_z: str = flag("group", "--loss tb: group (log Ẑ of a prompt estimated from its K "
                               "completions in the batch, VarGrad) or learned (a log Z per "
                               "prompt trained with the policy by gradient descent at "
                               "--log-z-lr; GFlowNet red-teaming learns it)",
                      one_of("group", "learned"))
    log_z_lr: float = flag(1.0, "--log-z learned: its learning rate (plain gradient descent: "
                                "each step moves a prompt's log Z 2·lr/B of the way to its "
                                "group's estimate; B/2: all the way)", POSITIVE)


# A setting that acts only with another (config.NEEDS): (name, does it act in run c?, on what,
# why not, fix)
NEEDS = [("log_z_lr", lambda c: c.log_z == "learned", "a learned log Z", "--log-z is group",
          "add --log-z learned, or ")]


def check(cfg):
    if cfg.log_z != "group" and not cfg.loss.startswith("tb"):     # tb and its stale-data forms
        raise ValueError(f"--log-z {cfg.log_z} shapes trajectory balance's target, and --loss "
                         f"is {cfg.loss}: use --loss tb, or drop it")


class LearnedLogZ(torch.nn.Module):
    """log Z(x) for prompts 0 .. n_prompts − 1, NaN until the prompt's first group."""

    def __init__(self, n_prompts, lr):
        super().__init__()
        self.values = torch.nn.Parameter(torch.full((n_prompts,), float("nan")))   # [P]
        self.lr = lr

    def forward(self, prompt_index):
        """[B] prompt indices -> [B] their log Z, with the gradient; NaN: not seen yet."""
        return self.values[prompt_index]

    @torch.no_grad()
    def first_seen(self, prompt_index, estimate):
        """Set the entries still NaN to `estimate` [B], the group estimates the loss used for
        them (a prompt twice in a batch: its first group's)."""
        for index, value in zip(prompt_index.tolist(), estimate.tolist()):
            if self.values[index].isnan():
                self.values[index] = value

    @torch.no_grad()
    def step(self, loss_scale=1.0, skip=False):
        """One gradient-descent step on the gradient the loss left (entries of prompts not in
        the batch have none), then forget it. `loss_scale`: the factor float16's GradScaler
        multiplied the loss by, which the gradient carries; `skip`: the scaler skipped the
        policy's step (an overflow), so this one is skipped too."""
        grad, self.values.grad = self.values.grad, None
        if grad is not None and not skip:
            self.values -= self.lr * grad / loss_scale
