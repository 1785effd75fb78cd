"""Red-teaming: TB synchronous and asynchronous, and RLOO, same trained samples, several seeds.

    python bench/redteam.py [--seeds 0 1 2] [--settings ...] [--runs runs/bench-redteam] [--plot FILE.png]

Settings of `python tba.py --task redteam` (its defaults: 30 steps of 4 prompts × 4 attacks,
β = 0.1), each with every seed:
  tb-sync         --searchers 0   trajectory balance, on-policy
  tb-async        --searchers 1   trajectory balance from a searcher's replay buffer
  rloo-beta0.01   --searchers 0 --loss rloo --beta 0.01   RLOO with a 10× weaker KL penalty
  rloo-sync       --searchers 0 --loss rloo   (not run by default: at the same β its gradient
                  is (β/2)·K/(K−1) times TB's on every batch, so after clipping and Adam it is
                  the same run as tb-sync: weights equal to 3e-6 after 30 steps)
Each run is its own process, one after the other (a run takes ~8 minutes on 2 cores; a finished
run in --runs is not run again, so the script can be stopped and restarted). Then it prints, as
mean ± standard deviation over the seeds (min–max in brackets): the last evaluation's success
rate, diversity of the successful attacks and distinct successes among its 32 attacks; the
distinct successful attacks found over the whole run, at 2, 4 and 6 minutes and at the end; and
the wall time. `--plot` draws the run's distinct successes against wall time.
"""
import argparse
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import plot  # noqa: E402

SETTINGS = {"tb-sync": ["--searchers", "0"], "tb-async": ["--searchers", "1"],
            "rloo-beta0.01": ["--searchers", "0", "--loss", "rloo", "--beta", "0.01",
                              "--beta-final", "0.01"],
            "rloo-sync": ["--searchers", "0", "--loss", "rloo"]}
CHECKPOINTS_S = (120, 240, 360)           # "found so far" at these wall times


def run(setting, seed, out):
    if (out / "final").is_dir():
        return
    done = subprocess.run([sys.executable, "tba.py", "--task", "redteam", *SETTINGS[setting],
                           "--seed", str(seed), "--quiet", "--out", str(out)], cwd=REPO)
    if done.returncode:
        sys.exit(f"error: the {setting} run with seed {seed} failed (exit {done.returncode})")


def found_by(train_rows, seconds):
    """Distinct successful attacks found by `seconds` of wall time (the last row before it)."""
    rows = [r for r in train_rows if r["time"] <= seconds]
    return rows[-1]["redteam/unique_successes"] if rows else 0


def summary(out):
    train_rows, eval_rows = plot.read_metrics(out)
    end = eval_rows[-1]
    return {"success_rate": end["eval/success_rate"], "diversity": end["eval/diversity"],
            "eval_unique": end["eval/unique_successes"],
            **{f"found_{s}s": found_by(train_rows, s) for s in CHECKPOINTS_S},
            "found": train_rows[-1]["redteam/unique_successes"], "wall": eval_rows[-1]["time"]}


def spread(values, digits):
    mean = statistics.mean(values)
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:.{digits}f} ± {sd:.{digits}f} [{min(values):.{digits}f}–{max(values):.{digits}f}]"


def draw(runs, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for i, (setting, outs) in enumerate(runs.items()):
        for j, out in enumerate(outs):
            train_rows, _ = plot.read_metrics(out)
            ax.plot([r["time"] for r in train_rows], [r["redteam/unique_successes"] for r in train_rows],
                    color=f"C{i}", label=setting if j == 0 else None, linewidth=1.2)
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("distinct successful attacks found")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--settings", nargs="+", choices=SETTINGS,
                        default=["tb-sync", "tb-async", "rloo-beta0.01"])
    parser.add_argument("--runs", default="runs/bench-redteam", help="folder for the runs")
    parser.add_argument("--plot", default="", help="write the found-over-time plot here (.png)")
    args = parser.parse_args()
    runs = {setting: [Path(args.runs) / f"{setting}-s{seed}" for seed in args.seeds]
            for setting in args.settings}
    for seed_index in range(len(args.seeds)):       # seed by seed: every setting gets its runs
        for setting, outs in runs.items():
            run(setting, args.seeds[seed_index], outs[seed_index])
    columns = [("success_rate", 3), ("diversity", 3), ("eval_unique", 1),
               *((f"found_{s}s", 1) for s in CHECKPOINTS_S), ("found", 1), ("wall", 0)]
    print(f"| setting ({len(args.seeds)} seeds) | eval success rate | eval diversity of successes "
          "| eval distinct successes (of 32) | "
          + " | ".join(f"found by {s // 60} min" for s in CHECKPOINTS_S)
          + " | found in the run | wall (s) |\n|" + " --- |" * (len(columns) + 1))
    for setting, outs in runs.items():
        rows = [summary(out) for out in outs]
        print(f"| {setting} | " + " | ".join(spread([r[key] for r in rows], digits)
                                            for key, digits in columns) + " |")
    if args.plot:
        draw(runs, args.plot)
        print(f"\n{args.plot}")


if __name__ == "__main__":
    main()
