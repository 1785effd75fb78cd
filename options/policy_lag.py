"""--lag L: the synchronous loop sampling with the policy as it was exactly L updates earlier:
staleness without replay, timing or randomness of processes, so that a lag sweep isolates what
staleness alone costs (bench/lag.py).

`Lag.sampling_model` writes the weights of each version to RUN/lag/ and loads version v − L into a
separate model: one more copy of the weights in memory, L + 1 files on disk (SmolLM2-135M: 0.54
GB each, 9.2 GB at L = 16; in memory, 16 copies beside the trainer's activations would not leave
room for a second run on 24 GB). Each checkpoint kept on disk keeps the files its next steps
sample with, so a run resumed from any kept checkpoint samples with the same old weights as one
that never stopped.
"""
import copy
from dataclasses import dataclass
from pathlib import Path

import torch

from plumbing import checkpoint
from plumbing.flags import at_least, flag
from devices.weights import copy_weights, shipped_state


@dataclass
class Settings:
    """an exact policy lag (options/policy_lag.py)"""
    lag: int = flag(0, "--searchers 0 only: sample each step's groups with the policy as it was "
                       "exactly this many updates earlier (the first steps: with the initial "
                       "weights), to measure staleness alone; keeps the last L + 1 versions "
                       "of the weights (and those each kept checkpoint needs) as files in "
                       "RUN/lag/ and one more copy in memory (0: on-policy)", at_least(0))


def check(cfg):
    if cfg.lag and cfg.searchers:
        raise ValueError(f"--lag {cfg.lag} delays the synchronous loop's sampler, but --searchers "
                         f"{cfg.searchers} samples in other processes, as stale as they come: "
                         "use --searchers 0 with --lag, or drop --lag")


class Lag:
    """The lagged sampler of a --lag run and the weight files behind it (RUN/lag/)."""

    def __init__(self, lag, policy, out):
        self.lag, self.out, self.dir = lag, Path(out), Path(out) / "lag"
        self.model = copy.deepcopy(policy).requires_grad_(False)    # the lagged sampler
        self.version = None               # the version of the weights `model` holds

    def sampling_model(self, policy, version):
        """The model to sample step `version + 1`'s groups with: the policy's weights of
        max(version − L, 0), after saving the policy's weights now as `version`, and deleting
        the files that no step or kept checkpoint needs. -> (model, its version)"""
        self.save(policy, version)
        sampled = max(version - self.lag, 0)
        if sampled != self.version:
            copy_weights(self.model, torch.load(self.file(sampled), mmap=True, weights_only=True))
            self.version = sampled
        self.delete_before(min([sampled, *self.needed_by_checkpoints()]))
        return self.model, sampled

    def file(self, version):
        return self.dir / f"version_{version}.pt"

    def save(self, policy, version):
        self.dir.mkdir(parents=True, exist_ok=True)
        weights = {k: v.detach().cpu() for k, v in shipped_state(policy).items()}
        checkpoint.write_file(self.file(version), lambda f: torch.save(weights, f))

    def needed_by_checkpoints(self):
        """The oldest version each checkpoint on disk samples with next: a checkpoint written
        after step s resumes with step s + 1, which samples version s − L."""
        return [max(checkpoint.step_of(c) - self.lag, 0)
                for c in checkpoint.all_checkpoints(self.out)]

    def delete_before(self, version):
        for old in self.dir.glob("version_*.pt"):
            if int(old.stem.split("_")[1]) < version:
                old.unlink()

    def check_resume(self, step):
        """A run resumed after `step` needs the files of versions step − L .. step − 1."""
        missing = [v for v in range(max(step - self.lag, 0), step) if not self.file(v).is_file()]
        if missing:
            raise ValueError(f"{self.dir} lacks the weights of version {missing[0]} that --lag "
                             f"{self.lag} samples with after step {step}: they were deleted; "
                             "start the run again")
