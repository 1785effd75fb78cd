"""Async scaling by simulation: the real orchestration with generation and training replaced by
calibrated sleeps, for N = 1, 2, 4, 8 searchers, against the synchronous loop and the ideal.

    python bench/scaling.py [--gen-seconds 4] [--train-seconds 1] [--searchers 1 2 4 8]

Everything real runs: `tba.train`, the searcher processes, the shared-memory buffer, weight
sync every k steps, replay sampling and metrics, on the toy task. Only the two costs are
simulated, as a GPU would make them: each `generate` call (one batch of B prompts × K
completions) sleeps --gen-seconds first, and each gradient step sleeps --train-seconds. Sleeps
do not compete for this machine's cores, so N searchers behave like N GPUs.

The ideal rate is min(N / gen_seconds, 1 / train_seconds) steps per second: N searchers produce
N batches per gen_seconds and the trainer takes train_seconds per batch. With replay the trainer
never has to wait, so the measured rate is the smaller of the trainer's steps/s and the fresh
data rate (groups generated per second / B): the rate at which new samples are trained on.
Goal: >= 0.95 of the ideal at every N, i.e. nothing in the machinery serialises the work.
"""
import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import config  # noqa: E402
from plumbing import plot  # noqa: E402
import tba  # noqa: E402
from assembly import load  # noqa: E402
from tasks.toy import ToyTask  # noqa: E402


class SimulatedCosts(torch.nn.Module):
    """Wraps the toy model: generation and gradient steps take the simulated time, then run."""

    def __init__(self, model, gen_seconds, train_seconds):
        super().__init__()
        self.model, self.gen_seconds, self.train_seconds = model, gen_seconds, train_seconds

    def generate(self, *args, **kwargs):
        time.sleep(self.gen_seconds)
        return self.model.generate(*args, **kwargs)

    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled():           # the trainer's forward: one per step (micro_groups=0)
            time.sleep(self.train_seconds)
        return self.model(*args, **kwargs)

    def __getattr__(self, name):               # config, generation_config, device, ...
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.model, name)


class SimTask(ToyTask):
    """The toy task with simulated costs; they come from the environment so that the searcher
    processes (started with spawn, given only the config) see them too."""

    def load_model(self, device):
        model, tokenizer = super().load_model(device)
        costs = float(os.environ["TBA_SIM_GEN_SECONDS"]), float(os.environ["TBA_SIM_TRAIN_SECONDS"])
        return SimulatedCosts(model, *costs), tokenizer


def measure(searchers, steps, out):
    """Run tba on the simulated task. -> (trainer steps/s, fresh data steps/s) after warm-up"""
    argv = ["--task", "scaling:SimTask", "--searchers", str(searchers), "--steps", str(steps),
            "--eval-every", "0", "--save-every", "0", "--quiet", "--out", str(out)]
    cfg = config.resolve(config.parse_args(argv)[0])
    tba.train(cfg, load.load(cfg))
    rows, _ = plot.read_metrics(out)                          # the training rows
    rows = rows[len(rows) // 5:]                              # skip the warm-up
    first, last = rows[0], rows[-1]
    trainer_rate = (last["step"] - first["step"]) / (last["time"] - first["time"])
    # Batches arrive a few per window: count them between the first and the last step that saw
    # a new one, not over the whole window, or one batch more or less moves the rate by 1/count.
    arrivals = [b for a, b in zip(rows, rows[1:]) if b["gen_groups"] > a["gen_groups"]]
    if len(arrivals) < 2:
        print(f"error: batches that arrived in the measured window: {len(arrivals)}, too few "
              "to measure a rate; give a longer --seconds", file=sys.stderr)
        sys.exit(2)
    first, last = arrivals[0], arrivals[-1]
    data_rate = ((last["gen_groups"] - first["gen_groups"]) / (last["time"] - first["time"])
                 / cfg.prompts_per_step)
    return trainer_rate, data_rate


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gen-seconds", type=float, default=4.0,
                        help="simulated time to generate one batch (B prompts x K completions)")
    parser.add_argument("--train-seconds", type=float, default=1.0,
                        help="simulated time of one trainer step")
    parser.add_argument("--searchers", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--seconds", type=float, default=60.0, help="length of each measured run")
    args = parser.parse_args()
    os.environ["TBA_SIM_GEN_SECONDS"] = str(args.gen_seconds)
    os.environ["TBA_SIM_TRAIN_SECONDS"] = str(args.train_seconds)
    os.environ["OMP_NUM_THREADS"] = "1"   # sleeps stand in for the work: keep the rest light
    torch.set_num_threads(1)
    # Sleeping searchers need no core of their own: let the placement check accept N > cores.
    os.cpu_count = lambda: max(args.searchers) + 1
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        sync_ideal = 1 / (args.gen_seconds + args.train_seconds)
        trainer_rate, data_rate = measure(0, max(6, math.ceil(args.seconds * sync_ideal)),
                                          Path(tmp) / "sync")
        results.append(("sync", trainer_rate, sync_ideal))
        for n in args.searchers:
            ideal = min(n / args.gen_seconds, 1 / args.train_seconds)
            # With replay the trainer runs at its own rate whatever N is.
            trainer_rate, data_rate = measure(n, math.ceil(args.seconds / args.train_seconds),
                                              Path(tmp) / f"async-{n}")
            results.append((f"async_{n}_searchers", min(trainer_rate, data_rate), ideal))
    for name, rate, ideal in results:
        print(f"scaling_{name}_steps_per_s {rate:.3f} steps/s")
        print(f"scaling_{name}_of_ideal {rate / ideal:.3f} ratio")
    print(f"\n| simulated: generate {args.gen_seconds:g} s/batch, train {args.train_seconds:g} s/step "
          "| steps/s | ideal | of ideal | speed-up over sync |\n| --- | --- | --- | --- | --- |")
    sync_rate = results[0][1]
    for name, rate, ideal in results:
        goal = "" if name == "sync" else (" (met)" if rate >= 0.95 * ideal else " (missed)")
        print(f"| {name.replace('_', ' ')} | {rate:.3f} | {ideal:.3f} | {rate / ideal:.3f}{goal} "
              f"| {rate / sync_rate:.2f}x |")


if __name__ == "__main__":
    main()
