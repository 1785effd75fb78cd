"""Curves of one run, or of several overlaid: `python tba.py plot runs/a [runs/b ...]`.

Reads each run's metrics.jsonl and writes two PNGs, the same panels against trainer step and
against wall time: the training signals (reward, loss, log Ẑ, KL, staleness, and what may move
before learning falls: ESS/N, gradient norm, log π of the samples, length), the task's own
training-row metrics (`redteam/success_rate`, ...) and every metric the task's evaluation logged
(`eval/accuracy`, `toy/tv`, ...). Wall time is how asynchronous and
synchronous runs are compared: the same curve reached sooner. matplotlib is only needed here.
"""
import argparse
import json
import sys
import tempfile
from pathlib import Path

TRAINING_PANELS = {"reward_mean": "mean reward", "loss": "loss", "log_z": "log Ẑ",
                   "kl": "KL: mean log p_θ − log p_ref", "staleness_mean": "staleness (steps)",
                   "ess_frac": "ESS/N of the weights π/μ",
                   "grad_norm": "gradient norm before clipping",
                   "logp_mean": "mean log π of the trained completions",
                   "response_len_mean": "mean response length (tokens)",
                   "equal_reward_frac": "share of groups with one reward"}
NOT_PLOTTED = {"step", "time", "eval/n"}


def read_metrics(run):
    """-> (training rows, evaluation rows) of a run folder; a row with `loss` is a training row."""
    path = Path(run) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{run} has no metrics.jsonl: pass run folders written by tba.py")
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:          # the line a running (or crashed) run is still writing
            continue
    if not rows:
        raise ValueError(f"{path} has no rows yet: plot the run after its first evaluation or "
                         "step")
    return [r for r in rows if "loss" in r], [r for r in rows if "loss" not in r]


def smooth(values, window):
    """Trailing moving average: training signals are noisy step to step."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_runs(runs, out_dir):
    """Write <out_dir>/curves_by_step.png and curves_by_time.png. -> their paths"""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = {Path(run).name: read_metrics(run) for run in runs}
    eval_keys = sorted({k for _, evals in data.values() for r in evals for k, v in r.items()
                        if k not in NOT_PLOTTED and isinstance(v, (int, float))})
    task_keys = sorted({k for train, _ in data.values() for r in train for k in r if "/" in k})
    panels = ([(k, TRAINING_PANELS[k], 0) for k in TRAINING_PANELS] + [(k, k, 0) for k in task_keys]
              + [(k, k, 1) for k in eval_keys])
    out_dir = Path(out_dir)
    try:                                   # before drawing: a folder that cannot take the PNGs
        out_dir.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=out_dir).close()
    except OSError as e:
        raise ValueError(f"--out {out_dir}: cannot write there ({e.strerror}): pass a writable "
                         "folder") from None
    paths = []
    for x_key, x_label in (("step", "trainer step"), ("time", "wall time (s)")):
        cols = 3
        rows = -(-len(panels) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.0 * rows), squeeze=False)
        for ax, (key, title, source) in zip(axes.flat, panels):
            for i, (name, tables) in enumerate(data.items()):
                points = [(r[x_key], r[key]) for r in tables[source] if r.get(key) is not None]
                if not points:
                    continue
                xs, ys = zip(*points)
                color = f"C{i}"
                if source == 0:                  # raw steps faint, the moving average on top
                    ax.plot(xs, ys, color=color, alpha=0.2, linewidth=0.8)
                    ys = smooth(list(ys), max(1, len(ys) // 50))
                    ax.plot(xs, ys, color=color, label=name, linewidth=1.5)
                else:
                    ax.plot(xs, ys, color=color, marker="o", markersize=3, label=name)
            ax.set_title(title, fontsize=10)
            ax.set_xlabel(x_label, fontsize=8)
            ax.tick_params(labelsize=8)
            ax.grid(alpha=0.3)
        for ax in list(axes.flat)[len(panels):]:
            ax.set_visible(False)
        axes.flat[0].legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"curves_by_{x_key}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv):
    parser = argparse.ArgumentParser(prog="tba.py plot", description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", help="run folders (runs/<name>) to draw, overlaid")
    parser.add_argument("--out", default="", help="folder for the PNGs (default: <first run>/plots)")
    args = parser.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("error: plotting needs matplotlib: pip install matplotlib", file=sys.stderr)
        return 2
    try:
        paths = plot_runs(args.runs, args.out or Path(args.runs[0]) / "plots")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0
