"""Real asynchronous against synchronous training on this CPU: same cores, same trained samples.

    python bench/async_vs_sync.py [--tasks toy arith] [--toy-steps 300] [--arith-steps 4]

For each task, three real runs of tba.py:
  sync      --searchers 0: generate, then train, in one process using every core;
  async     --searchers 1: one searcher and the trainer, the cores split between them;
  parts     --searchers 0 on one core: the time to generate one batch and to take one step,
            each alone, as the async processes see them.
Wall time is the training loop's (first training row back to the step-0 evaluation), so model
loading and evaluation are left out. The async wall also holds its start-up: spawning the
searcher process, which imports torch and loads its models, then the first batch. After that,
with replay the trainer never waits, so each step should take what one step alone takes:
steady-state speed-up = (sync wall / steps) / (async seconds per step after its first step),
ideal = (sync wall / steps) / (one step alone).
"""
import argparse
import os
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import config  # noqa: E402
from plumbing import plot  # noqa: E402
import tba  # noqa: E402
from assembly import load  # noqa: E402


def run(task, steps, searchers, out, cores=None, extra=()):
    """One real run. -> (loop wall seconds, mean search_s, mean train_s, its config)"""
    real_cpu_count = os.cpu_count
    if cores:                              # placement splits os.cpu_count() between processes
        os.cpu_count = lambda: cores
    try:
        cfg = config.resolve(config.parse_args(
            ["--task", task, "--searchers", str(searchers), "--steps", str(steps),
             "--eval-every", "0", "--save-every", "0", "--quiet", "--out", str(out), *extra])[0])
        tba.train(cfg, load.load(cfg))
    finally:
        os.cpu_count = real_cpu_count
    train_rows, eval_rows = plot.read_metrics(out)
    wall = train_rows[-1]["time"] - eval_rows[0]["time"]
    startup = train_rows[0]["time"] - eval_rows[0]["time"]       # up to the end of step 1
    per_step = (train_rows[-1]["time"] - train_rows[0]["time"]) / (len(train_rows) - 1)
    mean = lambda key: sum(r[key] for r in train_rows) / len(train_rows)
    return SimpleNamespace(wall=wall, startup=startup, per_step=per_step,
                           search_s=mean("search_s"), train_s=mean("train_s"), cfg=cfg)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", nargs="+", default=["toy", "arith"])
    parser.add_argument("--toy-steps", type=int, default=300)
    parser.add_argument("--arith-steps", type=int, default=4)
    parser.add_argument("--arith-eval-n", type=int, default=8,
                        help="evaluation is outside the timed loop: keep it short")
    args = parser.parse_args()
    table = []
    with tempfile.TemporaryDirectory() as tmp:
        for task in args.tasks:
            steps = args.toy_steps if task == "toy" else args.arith_steps
            extra = () if task == "toy" else ("--eval-n", str(args.arith_eval_n))
            sync = run(task, steps, 0, Path(tmp) / f"{task}-sync", extra=extra)
            async_ = run(task, steps, 1, Path(tmp) / f"{task}-async", extra=extra)
            alone = run(task, max(2, steps // 4), 0, Path(tmp) / f"{task}-parts", cores=1,
                        extra=extra)
            sync_per_step = sync.wall / steps
            table.append(dict(
                task=task, steps=steps, sync_wall=sync.wall, async_wall=async_.wall,
                startup=async_.startup, speedup=sync.wall / async_.wall,
                steady=sync_per_step / async_.per_step, ideal=sync_per_step / alone.train_s,
                search_alone=alone.search_s, train_alone=alone.train_s))
    for r in table:
        for key, unit in [("sync_wall", "s"), ("async_wall", "s"), ("startup", "s"),
                          ("speedup", "x"), ("steady", "x"), ("ideal", "x")]:
            print(f"{r['task']}_{key} {r[key]:.2f} {unit}")
    print(f"\n| task ({os.cpu_count()} cores) | steps | sync wall | async wall (start-up) | speed-up "
          "| steady-state speed-up | ideal | of ideal | generate one batch alone | one step alone |"
          "\n| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in table:
        print(f"| {r['task']} | {r['steps']} | {r['sync_wall']:.1f} s | {r['async_wall']:.1f} s "
              f"({r['startup']:.1f} s) | {r['speedup']:.2f}x | {r['steady']:.2f}x "
              f"| {r['ideal']:.2f}x | {r['steady'] / r['ideal']:.2f} | {r['search_alone']:.2f} s "
              f"| {r['train_alone']:.2f} s |")


if __name__ == "__main__":
    main()
