"""The loggers people already use, beside metrics.jsonl: --report-to tensorboard,wandb.

    runs/<name>/tensorboard/   TensorBoard's event files:  tensorboard --logdir runs
    runs/<name>/wandb/         Weights & Biases' files; runs/<name>/wandb-id holds the run's id

Each logger gets every row written to metrics.jsonl: the same keys, at the same steps (the
`step` key is the x-axis), and the run's settings (config.json) as the run's config. A resumed
run reports into the same TensorBoard folder and the same wandb run. The steps it redoes after
its checkpoint were reported before it stopped, and a resumed run repeats them bit for bit
(only wall-clock keys differ), so they are not sent twice.

The packages are optional: `make install-loggers`. wandb logs online when logged in (`wandb
login`), else set WANDB_MODE=offline and `wandb sync` later; WANDB_PROJECT names the project
(default: tba).
"""
import importlib.util
import json
import netrc
import os
import secrets
from pathlib import Path

from plumbing import checkpoint

CHOICES = ("tensorboard", "wandb")
INSTALL = "make install-loggers"


def names(report_to):
    """'tensorboard,wandb' -> ['tensorboard', 'wandb']"""
    return [name for name in report_to.split(",") if name]


def check(report_to):
    """The loggers' packages are installed and wandb can log: one-line errors before anything
    loads."""
    for name in names(report_to):
        if importlib.util.find_spec(name) is None:
            raise ValueError(f"--report-to {name}: the {name} package is not installed: "
                             f"install it with `{INSTALL}`")
    if "wandb" in names(report_to) and os.environ.get("WANDB_MODE") not in ("offline", "disabled"):
        if not (os.environ.get("WANDB_API_KEY") or wandb_login_in_netrc()):
            raise ValueError("--report-to wandb: not logged in to wandb: run `wandb login`, or "
                             "set WANDB_MODE=offline to log to files and `wandb sync` them later")


def wandb_login_in_netrc():
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


class TensorBoard:
    def __init__(self, out, record, resume):
        from torch.utils.tensorboard import SummaryWriter
        self.writer = SummaryWriter(log_dir=str(Path(out) / "tensorboard"))
        if not resume:
            self.writer.add_text("config", "```\n" + json.dumps(record, indent=2) + "\n```")

    def log(self, row):
        for key, value in row.items():
            if key != "step":
                self.writer.add_scalar(key, value, global_step=row["step"])
        self.writer.flush()                  # on disk every row, like metrics.jsonl

    def close(self):
        self.writer.close()


class WandB:
    def __init__(self, out, record, resume, quiet):
        import wandb
        id_file = Path(out) / "wandb-id"
        run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(4)
        checkpoint.write_file(id_file, lambda f: f.write(run_id.encode()))
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "tba"), name=Path(out).name,
                              id=run_id, resume="allow", dir=str(out), config=record["config"],
                              settings=wandb.Settings(silent=quiet))

    def log(self, row):
        self.run.log(row, step=row["step"])

    def close(self):
        self.run.finish()


def open_loggers(report_to, *, out, record, resume, quiet):
    """The loggers named in --report-to, started. -> [logger with .log(row) and .close()]"""
    made = {"tensorboard": lambda: TensorBoard(out, record, resume),
            "wandb": lambda: WandB(out, record, resume, quiet)}
    return [made[name]() for name in names(report_to)]
