"""Checkpoints: everything a run needs to continue exactly where it stopped.

    runs/<name>/checkpoints/step_<N>/
        model/        the policy and its tokenizer, HF format (`from_pretrained` loads it)
        trainer.pt    optimiser, scheduler, RNG states, step and counters
        buffer.pt     the replay buffer's groups (asynchronous runs only)

A checkpoint is written into `checkpoints/.tmp-step_<N>/` and renamed to `step_<N>/` once every
file is in place. A rename is atomic, so a crash part-way leaves only a temporary folder (ignored,
and removed by the next save) next to the previous, intact checkpoint. `.pt` files are read with
`torch.load(weights_only=True)`: a checkpoint can hold tensors and plain values, never code.
"""
import shutil
from pathlib import Path

import torch


class CheckpointError(ValueError):
    """A checkpoint is missing or unreadable; the message says which and what to do."""


def step_of(path):
    return int(path.name.split("_")[1])


def all_checkpoints(run_dir):
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / "checkpoints"
    found = [p for p in root.glob("step_*") if p.name.split("_")[1].isdigit()] if root.is_dir() else []
    return sorted(found, key=step_of)


def latest(run_dir):
    """The newest complete checkpoint of a run, or None."""
    found = all_checkpoints(run_dir)
    return found[-1] if found else None


def save_pretrained(model, tokenizer, folder):
    """Write an HF model folder atomically: into a temporary sibling, then renamed over `folder`."""
    folder = Path(folder)
    tmp, old = folder.with_name(".tmp-" + folder.name), folder.with_name(".old-" + folder.name)
    for leftover in (tmp, old):
        shutil.rmtree(leftover, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if folder.exists():
        folder.rename(old)
    tmp.rename(folder)
    shutil.rmtree(old, ignore_errors=True)
    return folder


def save(run_dir, step, model, tokenizer, trainer_state, buffer_state=None, keep=2):
    """Write checkpoint `step` and keep only the `keep` newest. -> its folder

    The state at a step boundary is fully determined by the step, so a checkpoint that already
    exists (a periodic save followed by Ctrl-C at the same step) is not written twice.
    """
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step}"
    if final.exists():
        return final
    for leftover in root.glob(".tmp-*"):          # from a save that crashed part-way
        shutil.rmtree(leftover)
    tmp = root / f".tmp-step_{step}"
    tmp.mkdir()
    model.save_pretrained(tmp / "model")
    tokenizer.save_pretrained(tmp / "model")
    torch.save(trainer_state, tmp / "trainer.pt")
    if buffer_state is not None:
        torch.save(buffer_state, tmp / "buffer.pt")
    tmp.rename(final)
    for old in all_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old)
    return final


def load(path, model):
    """Load the weights of checkpoint `path` into `model` (in place, keeping its device and
    dtype). -> (trainer_state, buffer_state or None)"""
    path = Path(path)
    hint = f"delete {path} to resume from the checkpoint before it"
    try:
        trainer_state = torch.load(path / "trainer.pt", weights_only=True)
        buffer_file = path / "buffer.pt"
        buffer_state = torch.load(buffer_file, weights_only=True) if buffer_file.exists() else None
        saved = type(model).from_pretrained(path / "model", dtype=next(model.parameters()).dtype)
        model.load_state_dict(saved.state_dict())
    except Exception as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"checkpoint {path} is unreadable ({reason}): {hint}") from e
    if trainer_state.get("step") != step_of(path):
        raise CheckpointError(f"checkpoint {path} holds step {trainer_state.get('step')}: {hint}")
    return trainer_state, buffer_state
