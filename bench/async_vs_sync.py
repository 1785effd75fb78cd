"""Real asynchronous against synchronous training on this CPU: same cores, same trained samples.

    python bench/async_vs_sync.py [--tasks toy arith] [--toy-steps 300] [--arith-steps 4]

For each task, three real runs of tba.py:
  sync      --searchers 0: generate, then train, in one process using every core;
  async     --searchers 1: one searcher and the trainer, the cores split between them;
  parts     --searchers 0 on one core: the time to generate one batch and to take one step,
            each alone, as the async processes see them.
Wall time is the training loop's (first training row back to the step-0 evaluation), so model
loading and evaluation are left out. With replay the async trainer never waits once the buffer
holds its first groups, so its ideal wall time is that warm-up plus steps × one step alone:
ideal speed-up = sync wall / (warm-up + steps × train_s alone).
"""
import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import tba  # noqa: E402


def run(task, steps, searchers, out, cores=None, extra=()):
    """One real run. -> (loop wall seconds, mean search_s, mean train_s, its config)"""
    real_cpu_count = os.cpu_count
    if cores:                              # placement splits os.cpu_count() between processes
        os.cpu_count = lambda: cores
    try:
        cfg = tba.resolve(tba.parse_args(
            ["--task", task, "--searchers", str(searchers), "--steps", str(steps),
             "--eval-every", "0", "--save-every", "0", "--quiet", "--out", str(out), *extra])[0])
        tba.train(cfg)
    finally:
        os.cpu_count = real_cpu_count
    rows = [json.loads(line) for line in open(Path(out) / "metrics.jsonl")]
    train_rows = [r for r in rows if "loss" in r]
    wall = train_rows[-1]["time"] - rows[0]["time"]
    mean = lambda key: sum(r[key] for r in train_rows) / len(train_rows)
    return wall, mean("search_s"), mean("train_s"), cfg


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
            sync_wall, _, _, cfg = run(task, steps, 0, Path(tmp) / f"{task}-sync", extra=extra)
            async_wall, _, _, _ = run(task, steps, 1, Path(tmp) / f"{task}-async", extra=extra)
            part_steps = max(2, steps // 4)
            _, search_alone, train_alone, _ = run(task, part_steps, 0, Path(tmp) / f"{task}-parts",
                                                  cores=1, extra=extra)
            warmup_batches = -(-max(cfg.min_buffer, cfg.prompts_per_step) // cfg.prompts_per_step)
            ideal_async = warmup_batches * search_alone + steps * train_alone
            samples = steps * cfg.prompts_per_step * cfg.group_size
            table.append((task, steps, samples, sync_wall, async_wall, sync_wall / async_wall,
                          sync_wall / ideal_async, search_alone, train_alone))
    cores = os.cpu_count()
    for task, _, _, sync_wall, async_wall, speedup, ideal, _, _ in table:
        print(f"{task}_sync_wall {sync_wall:.1f} s")
        print(f"{task}_async_wall {async_wall:.1f} s")
        print(f"{task}_speedup {speedup:.2f} x")
        print(f"{task}_ideal_speedup {ideal:.2f} x")
    print(f"\n| task ({cores} cores) | steps | samples | sync wall | async wall | speed-up | ideal "
          "| of ideal | generate one batch alone | one step alone |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for task, steps, samples, sync_wall, async_wall, speedup, ideal, search, train in table:
        print(f"| {task} | {steps} | {samples} | {sync_wall:.1f} s | {async_wall:.1f} s "
              f"| {speedup:.2f}x | {ideal:.2f}x | {speedup / ideal:.2f} | {search:.2f} s "
              f"| {train:.2f} s |")


if __name__ == "__main__":
    main()
