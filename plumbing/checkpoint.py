"""Checkpoints: everything a run needs to continue exactly where it stopped.

    runs/<name>/checkpoints/step_<N>/
        model/        the policy and its tokenizer, HF format (`from_pretrained` loads it)
        trainer.pt    optimiser, scheduler, RNG states, step and counters
        buffer.pt     the replay buffer's groups (asynchronous runs only)

A checkpoint is written into `checkpoints/.tmp-step_<N>/` and renamed to `step_<N>/` once every
file is in place. A rename is atomic, so a crash part-way leaves only a temporary folder (ignored,
and removed by the next save) next to the previous, intact checkpoint. `.pt` files are read with
`torch.load(weights_only=True)`: a checkpoint can hold tensors and plain values, never code.
A write that fails (a full disk, a read-only folder, a quota) is a WriteError naming what could
not be written; the half-written temporary folder is removed to give the space back. Every other
file of a run is written the same way, through `write_file` (whole files: config.json, the --lag
weights) or `append_lines` (metrics.jsonl, samples.jsonl): a failure names the file and the
reason, and leaves no temporary file and no half line behind. A saved replay buffer is checked
by `ReplayBuffer.load_state_dict` before it is loaded (replay/saved_state.py).
"""
import os
import re
import shutil
from pathlib import Path

import torch


class CheckpointError(ValueError):
    """A checkpoint is missing or unreadable; the message says which and what to do."""


class WriteError(Exception):
    """A file of the run could not be written; the message names it and says why."""


def reason(error):
    """Why a write failed, in the system's words ("No space left on device"): from an OSError
    anywhere in the exception's chain (torch.save raises "unexpected pos" from the OSError of a
    full disk) or in safetensors' text ("... (os error 28)"); else the first line of the
    message, or the exception's type."""
    cause = error
    while cause is not None:
        if isinstance(cause, OSError) and cause.strerror:
            return cause.strerror
        cause = cause.__cause__ or cause.__context__
    text = str(error).strip()
    code = re.search(r"\(os error (\d+)\)", text)
    if code:
        return os.strerror(int(code.group(1)))
    return text.splitlines()[0] if text else type(error).__name__


def write_file(path, write):
    """Write `path` whole or not at all: `write(f)` fills a temporary sibling (opened "wb"),
    which is then renamed over `path`. A failure removes the temporary and is a WriteError naming
    `path` and the reason. -> path"""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except Exception as e:
        tmp.unlink(missing_ok=True)
        raise WriteError(f"cannot write {path} ({reason(e)})") from e
    return path


def append_lines(path, lines):
    """Append these text lines to `path`, all of them or none: a failure cuts the file back to
    its length before and is a WriteError naming `path`."""
    path = Path(path)
    before = path.stat().st_size if path.exists() else 0
    try:
        with open(path, "a") as f:          # closed (and so flushed) here, errors included
            f.writelines(lines)
    except OSError as e:
        if path.exists():
            os.truncate(path, before)
        raise WriteError(f"cannot write {path} ({reason(e)})") from e


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
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    except BaseException as e:           # safetensors reports a full disk as its own error
        shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(e, Exception):     # a second Ctrl-C
            raise
        raise WriteError(f"cannot write {folder} ({reason(e)})") from e
    if folder.exists():
        folder.rename(old)
    tmp.rename(folder)
    shutil.rmtree(old, ignore_errors=True)
    return folder


def save(run_dir, step, model, tokenizer, trainer_state, keep=2):
    """Write checkpoint `step` and keep only the `keep` newest. -> its folder

    `trainer_state` is `run.state(...)`; the replay buffer in it (trainer_state["source"]
    ["buffer"], asynchronous runs only) goes to its own file, buffer.pt. The state at a step
    boundary is fully determined by the step, so a checkpoint that already exists (a periodic
    save followed by Ctrl-C at the same step) is not written twice.
    """
    root = Path(run_dir) / "checkpoints"
    final = root / f"step_{step}"
    if final.exists():
        return final
    source = dict(trainer_state["source"])
    buffer_state = source.pop("buffer", None)
    tmp = root / f".tmp-step_{step}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        for leftover in root.glob(".tmp-*"):          # from a save that crashed part-way
            shutil.rmtree(leftover)
        tmp.mkdir()
        model.save_pretrained(tmp / "model")
        tokenizer.save_pretrained(tmp / "model")
        # through Python's file: a full disk then leaves its OSError for `reason` (torch's own
        # writer reports only "basic_ios::clear")
        with open(tmp / "trainer.pt", "wb") as f:
            torch.save({**trainer_state, "source": source}, f)
        if buffer_state is not None:
            with open(tmp / "buffer.pt", "wb") as f:
                torch.save(buffer_state, f)
    except BaseException as e:           # a second Ctrl-C too: no half-written folder stays
        shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(e, Exception):
            raise
        raise WriteError(f"cannot write checkpoint {final} ({reason(e)})") from e
    tmp.rename(final)
    for old in all_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old)
    return final


def load(path, model):
    """Load the weights of checkpoint `path` into `model` (in place, keeping its device and
    dtype). -> the trainer state, its replay buffer (if any) back in state["source"]["buffer"]"""
    path = Path(path)
    hint = f"delete {path} to resume from the checkpoint before it"
    try:
        trainer_state = torch.load(path / "trainer.pt", map_location="cpu", weights_only=True)
        buffer_file = path / "buffer.pt"
        if buffer_file.exists():
            trainer_state["source"]["buffer"] = torch.load(buffer_file, map_location="cpu",
                                                          weights_only=True)
        saved = type(model).from_pretrained(path / "model", dtype=next(model.parameters()).dtype)
        model.load_state_dict(saved.state_dict())
    except Exception as e:
        raise CheckpointError(f"checkpoint {path} is unreadable ({reason(e)}): {hint}") from e
    if trainer_state.get("step") != step_of(path):
        raise CheckpointError(f"checkpoint {path} holds step {trainer_state.get('step')}: {hint}")
    return trainer_state
