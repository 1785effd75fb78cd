"""A run's life outside the algorithm: its folder, its log, resuming it, stopping it, its failures.

    runs/<name>/config.json      every resolved setting, the software versions, where each
                                 process ran
    runs/<name>/metrics.jsonl    one JSON row per trainer step and per evaluation
    runs/<name>/checkpoints/     what `state` returns, written by checkpoint.py; `restore`
                                 reads the newest back
    runs/<name>/final/           the trained model, an HF folder
    runs/<name>/error.log        the traceback of a run that failed part-way

A new run never writes into another run's folder; `--resume` continues one with its own
settings (`resumed_config`) and state (`restore`). Ctrl-C or `kill` stops at the end of the
current step and writes a checkpoint there. A run that fails part-way ends with one `error:`
line saying where its metrics are and how to continue it.
"""
import dataclasses
import errno
import json
import os
import shutil
import signal
import sys
import tempfile
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from plumbing.staleness import GradientSketch
from plumbing import checkpoint
from plumbing.checkpoint import WriteError
from plumbing.errors import NonFiniteError, SearcherError


# What a run writes into its folder (the README's list above, and the loggers' and options'
# files): a new run's --out holds only these, or it is not this project's to write into.
RUN_FILES = {"config.json", "metrics.jsonl", "metrics.discarded.jsonl", "samples.jsonl",
             "weights.jsonl", "error.log", "checkpoints", "final", ".tmp-final", ".old-final",
             "lag", "tensorboard", "wandb", "wandb-id", "plots"}


def trained_steps(out):
    """The trainer steps a run folder's metrics.jsonl records (evaluation rows do not count)."""
    path = Path(out) / "metrics.jsonl"
    rows = path.read_text().splitlines() if path.is_file() else []
    return sum('"loss"' in row for row in rows)


def is_run(out):
    """A folder this project wrote a run into: its config.json is a run record."""
    try:
        return isinstance(json.loads((Path(out) / "config.json").read_text()).get("config"), dict)
    except (OSError, ValueError, AttributeError):
        return (Path(out) / "metrics.jsonl").is_file()


def saved_settings(run):
    """The settings a run folder's config.json stores: -> {name: value} (ValueError: not a run
    folder, or a corrupt record)."""
    path = Path(run) / "config.json"
    if not path.is_file():
        raise ValueError(f"{run} is not a run folder (it has no config.json): pass a folder "
                         "written by tba.py, such as runs/<name>")
    try:
        record = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path} is corrupt ({type(e).__name__}: {e}): the run cannot be resumed")
    if isinstance(record, dict) and "config" not in record:
        raise ValueError(f"{run} is not a run folder (its config.json is not a run's; a model "
                         "folder?): pass a folder written by tba.py, such as runs/<name>")
    try:
        saved = record["config"]
        assert isinstance(saved, dict)
    except (ValueError, KeyError, TypeError, AssertionError) as e:
        raise ValueError(f"{path} is corrupt ({type(e).__name__}: {e}): the run cannot be resumed")
    return saved


def failed_start(out):
    """A run folder that holds no trained step and no checkpoint: a start that failed, which
    the next start with the same --out replaces."""
    out = Path(out)
    return (is_run(out) and {p.name for p in out.iterdir()} <= RUN_FILES
            and checkpoint.latest(out) is None and not (out / "final").exists()
            and trained_steps(out) == 0)


def check_out_folder(cfg, try_writing=True):
    """The run folder can be written, and a new run writes only into a folder that is absent,
    empty, or a start of its own that failed: never into another run, nor among files that
    this project did not write (it would replace its final/ and checkpoints/ there)."""
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file: pass a folder")
    if not cfg.resume and out.is_dir() and any(out.iterdir()) and not failed_start(out):
        raise ValueError(occupied(out))
    parent = out
    while not parent.exists():               # the folder that the run's folder will go into
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"--out {out}: {parent} is a file, not a folder: pass another --out")
    try:                                     # the only sure test of "can I write here", root too
        if try_writing:
            tempfile.TemporaryDirectory(dir=parent).cleanup()
    except OSError as e:
        raise ValueError(f"--out {out}: cannot write in {parent} ({e.strerror}): pass a "
                         "writable folder") from None


def occupied(out):
    """Why a new run cannot go into the non-empty folder `out`, and what to do instead."""
    if not is_run(out):
        names = sorted(p.name + ("/" if p.is_dir() else "") for p in out.iterdir())
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        return (f"--out {out} is a folder that tba did not write (it holds {shown}): pass a new "
                "or empty folder, such as runs/<name>")
    latest = checkpoint.latest(out)
    if latest is not None:
        return (f"{out} already holds a run, checkpointed at {latest.name}: continue it with "
                f"--resume {out}, or pass another --out")
    if (out / "final").exists():
        return (f"{out} already holds a finished run (its model is in {out / 'final'}): pass "
                "another --out")
    steps = trained_steps(out)
    if steps:
        return (f"{out} holds a run that trained {steps} steps and wrote no checkpoint, so it "
                f"cannot be resumed: pass another --out, or delete {out} to start over there")
    strays = sorted(p.name for p in out.iterdir() if p.name not in RUN_FILES)
    return (f"{out} holds a run that stopped before its first step and files that tba did not "
            f"write ({', '.join(strays[:3])}): move those, or pass another --out")


def make_folder(cfg):
    """Create the run folder; a new run first removes what a failed start left there
    (`failed_start`: only this project's files, no trained step)."""
    out = Path(cfg.out)
    if not cfg.resume and out.is_dir() and failed_start(out):
        for entry in out.iterdir():
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    out.mkdir(parents=True, exist_ok=True)


# ---------------------------------------------------------------- resuming: the state


@dataclass
class Progress:
    """How far the run has come, over all its sessions."""
    step: int = 0                    # trainer updates done
    samples: int = 0                 # completions trained on
    tokens: int = 0                  # completion tokens generated
    groups: int = 0                  # groups generated
    elapsed: float = 0.0             # wall-clock seconds


def state(progress, *, optimizer, scheduler, scaler, task, source, log_z=None):
    """Everything a checkpoint holds besides the weights: with the weights, the run continues
    exactly where it stopped (the learning-rate schedule's length travels in `scheduler`)."""
    return {**dataclasses.asdict(progress), "task": task.state_dict(),
            "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict(), "source": source.state_dict(),
            **({"log_z": log_z.state_dict()} if log_z is not None else {}),
            "gradient_sketch": getattr(getattr(optimizer, "gradient_sketch", None), "previous", None),
            "rng": {"torch": torch.get_rng_state(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}}


def restore_gpu_rng(states):
    """Each GPU's random state, for the GPUs this machine has: a run may resume on one with fewer
    (the others' states are dropped, in one line) or more (those keep the seed's)."""
    there = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for index, state in enumerate(states[:there]):
        torch.cuda.set_rng_state(state, f"cuda:{index}")
    if len(states) > there:
        print(f"note: the checkpoint holds the random states of {len(states)} GPUs and this "
              f"machine has {there}: those of cuda:{there}–cuda:{len(states) - 1} are dropped",
              file=sys.stderr, flush=True)


def restore(run_dir, *, steps, policy, optimizer, scheduler, scaler, task, source, log_z=None):
    """Load the run's newest checkpoint into these, in place; `steps` is the resumed run's
    --steps, which may go past the schedule of its first session. -> Progress"""
    latest = checkpoint.latest(run_dir)
    print(f"resuming {run_dir} at {latest.name}", flush=True)
    saved = checkpoint.load(latest, policy)
    optimizer.load_state_dict(saved["optimizer"])
    optimizer.gradient_sketch = GradientSketch(policy, saved.get("gradient_sketch"))
    scheduler.load_state_dict(saved["scheduler"])
    scaler.load_state_dict(saved["scaler"])
    task.load_state_dict(saved["task"])
    if log_z is not None:
        log_z.load_state_dict(saved["log_z"])
    try:
        source.load_state_dict(saved["source"], step=saved["step"])
    except ValueError as e:
        raise checkpoint.CheckpointError(f"{latest / 'buffer.pt'} is invalid ({e}): delete "
                                         f"{latest} to resume from the checkpoint before it") from None
    torch.set_rng_state(saved["rng"]["torch"])
    restore_gpu_rng(saved["rng"]["cuda"])
    schedule = scheduler.lr_lambdas[0]
    if steps > schedule.total_steps:
        print(f"note: the learning-rate schedule was set for {schedule.total_steps} steps; steps "
              f"past them train at lr {scheduler.get_last_lr()[0]:.3g} and below", file=sys.stderr)
    return Progress(**{f.name: saved[f.name] for f in dataclasses.fields(Progress)})


# ---------------------------------------------------------------- the folder's files
def write_json(path, value):
    """Write JSON atomically: a crash leaves the old file or the new one, never half of one."""
    checkpoint.write_file(path, lambda f: f.write(json.dumps(value, indent=2).encode()))


def run_record(cfg, layout):
    """config.json: every resolved setting, the software versions and where each process ran."""
    import platform
    import subprocess
    import transformers
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=Path(__file__).parent).stdout.strip() or None
    return {"config": dataclasses.asdict(cfg),
            "versions": {"tba": commit, "python": platform.python_version(),
                         "torch": torch.__version__, "transformers": transformers.__version__},
            "layout": {"trainer": str(layout.device), "searchers": layout.searcher_devices,
                       "threads_per_process": layout.threads, "cpu_count": os.cpu_count(),
                       "gpus": layout.gpus}}


class MetricsLog:
    """Appends one JSON object per line to runs/<name>/metrics.jsonl, on disk after every row,
    and hands each row to the --report-to loggers (loggers.py)."""

    def __init__(self, path, resume_step=None, loggers=()):
        """With `resume_step`, the rows after that step (written after the checkpoint, by a run
        that then died) are moved to metrics.discarded.jsonl: the resumed run redoes them, and
        the loggers, which have them already, do not get them again."""
        self.path = path = Path(path)
        self.loggers, self.reported = list(loggers), set()   # (step, training?) the loggers have
        if resume_step is not None and path.exists():
            rows = path.read_text().splitlines(keepends=True)
            kinds = [MetricsLog.kind_of(r) for r in rows]
            self.reported = {kind for kind in kinds if kind}
            keep = [kind is not None and kind[0] <= resume_step for kind in kinds]
            if not all(keep):
                checkpoint.append_lines(path.with_name("metrics.discarded.jsonl"),
                                        [r for r, k in zip(rows, keep) if not k])
                kept = "".join(r for r, k in zip(rows, keep) if k)
                checkpoint.write_file(path, lambda f: f.write(kept.encode()))

    @staticmethod
    def kind_of(line):
        """(step, whether it is a training step's row) of a metrics line; an evaluation's row
        has no loss. None for a line cut short by a crash."""
        try:
            row = json.loads(line)
            return row["step"], "loss" in row
        except (ValueError, KeyError, TypeError):
            return None

    def has_evaluation(self, step):
        """Did an earlier session of the run log an evaluation at `step`?"""
        return (step, False) in self.reported

    def write(self, row):
        checkpoint.append_lines(self.path, [json.dumps(row) + "\n"])
        if (row["step"], "loss" in row) not in self.reported:
            for logger in self.loggers:
                logger.log(row)

    def close(self):
        for logger in self.loggers:
            logger.close()


# ---------------------------------------------------------------- stopping and failing
class StopRequests:
    """Ctrl-C or `kill` while the run trains (`on_signals`): the first stops the run at the end of
    the current step, where no lock or queue is in use, and a checkpoint is saved there; a
    second one stops at once. `check` is where a requested stop happens: between steps, and
    while the trainer waits for groups."""

    def __init__(self):
        self.count = 0

    def request(self, signum, frame):
        self.count += 1
        if self.count > 1:
            raise KeyboardInterrupt
        os.write(2, b"\nstopping after this step (press Ctrl-C again to stop at once)\n")

    def check(self):
        if self.count:
            raise KeyboardInterrupt

    def between_steps(self):
        """Was the stop requested once, so that it happened at a step boundary?"""
        return self.count == 1

    @contextmanager
    def on_signals(self):
        """SIGINT and SIGTERM request a stop while the block runs."""
        self.count = 0
        previous = {sig: signal.signal(sig, self.request) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


class RunFailed(Exception):
    """The run stopped part-way for a reason other than bad input; the message says why."""


def failure(error, step, out):
    """The RunFailed that ends a run after `step` because of `error`. A searcher's death or a
    non-finite step explains itself; a failed write names what could not be written (nothing
    before it is lost); anything else leaves its traceback in error.log, if that can be written."""
    if isinstance(error, (SearcherError, NonFiniteError, WriteError)):
        return RunFailed(f"after step {step}: {error}")
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
        return RunFailed(f"after step {step}: cannot write {error.filename or 'in ' + str(out)} "
                         f"({error.strerror})")
    reason = f"after step {step}: {type(error).__name__}: {error}"
    try:
        (Path(out) / "error.log").write_text(traceback.format_exc())
        return RunFailed(f"{reason} (the traceback is in {Path(out) / 'error.log'})")
    except OSError:
        return RunFailed(reason)


def how_to_continue(out):
    """The rest of a failed run's error line: where its metrics are and how to go on."""
    latest = checkpoint.latest(out)
    if latest:
        how = f"continue it from {latest.name} with: python tba.py --resume {out}"
    elif failed_start(out):
        how = "no step was trained: the same command with the same --out starts it again"
    else:
        how = f"no checkpoint was written: start it again with another --out, or delete {out}"
    return f"metrics so far are in {out}/metrics.jsonl; {how}"