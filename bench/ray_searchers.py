"""Ray actors against searcher processes on this machine, and what travels over the network.

    python bench/ray_searchers.py [--steps 300] [--searchers 1]

1. The toy task, the same run twice (one after the other): `--searchers N` (processes, shared
   memory) and `--searchers N --ray local` (Ray actors, a Ray cluster on this machine). Printed:
   the first training step's time (start-up included), steady steps per second (after the
   first 20 steps), the mean time to publish weights (`sync_s`, every 2nd step), the share of the
   loop the trainer waited for data.
2. Bytes: what one weight sync ships (the shipped state dict, as Ray serialises it) for the toy
   and for SmolLM2-135M, and what one searched batch sends back per group (toy and arith).
Needs Ray: pip install 'ray==2.60.0' (make install-ray).
"""
import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import config  # noqa: E402
from plumbing import plot  # noqa: E402
from devices import weights  # noqa: E402
import tba  # noqa: E402
from assembly import load  # noqa: E402
from searcher import Searcher  # noqa: E402

WARM_UP = 20                  # steps left out of the steady rate (start-up, the first syncs)


def run(steps, searchers, out, ray):
    """One real toy run. -> its metrics row summary"""
    start = time.time()
    args = ["--task", "toy", "--searchers", str(searchers), "--steps", str(steps),
            "--eval-every", "0", "--save-every", "0", "--quiet", "--out", str(out)]
    cfg = config.resolve(config.parse_args(args + (["--ray", "local"] if ray else []))[0])
    tba.train(cfg, load.load(cfg))
    rows, _ = plot.read_metrics(out)
    steady = rows[WARM_UP:]
    loop = steady[-1]["time"] - steady[0]["time"]
    syncs = [r["sync_s"] for r in rows if r["sync_s"] > 0]
    return {"first_step_s": rows[0]["time"], "steps_per_s": (len(steady) - 1) / loop,
            "sync_ms": 1000 * sum(syncs) / len(syncs),
            "wait_frac": sum(r["trainer_wait_s"] for r in steady) / loop,
            "process_s": time.time() - start}


def serialised_bytes(value):
    import ray.cloudpickle
    return len(ray.cloudpickle.dumps(value))


def transfer_sizes():
    """-> {name: bytes} for one weight sync and one searched group."""
    sizes = {}
    for task_name in ("toy", "arith"):        # arith: SmolLM2-135M-Instruct
        cfg = config.resolve(config.parse_args(["--task", task_name, "--searchers", "1",
                                          "--out", "unused"])[0])
        searcher = Searcher(0, cfg, "cpu", 1)
        searcher.start(0)
        state = weights.shipped_state(searcher.policy)
        sizes[f"{task_name} weights, one sync"] = serialised_bytes(state)
        prompt_ids, batch, report = searcher.search(0)
        sizes[f"{task_name} one group back ({cfg.group_size} completions of at most "
              f"{cfg.max_new_tokens} tokens)"] = serialised_bytes((prompt_ids, batch, report)) / len(prompt_ids)
    return sizes


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--searchers", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {name: run(args.steps, args.searchers, Path(tmp) / name, ray)
                   for name, ray in (("processes", False), ("ray", True))}
    print(f"\ntoy, {args.steps} steps, {args.searchers} searcher(s)")
    print("| searchers | first training step (s) | steady steps/s | weight sync (ms) | "
          "trainer waiting | whole run (s) |\n| --- | --- | --- | --- | --- | --- |")
    for name, r in results.items():
        print(f"| {name} | {r['first_step_s']:.1f} | {r['steps_per_s']:.2f} | {r['sync_ms']:.1f} | "
              f"{r['wait_frac']:.0%} | {r['process_s']:.1f} |")
    print(f"ray / processes steady steps/s: "
          f"{results['ray']['steps_per_s'] / results['processes']['steps_per_s']:.2f}")
    print("\nbytes over the network (as Ray serialises them)")
    for name, size in transfer_sizes().items():
        print(f"{name}: {size / 1e6:.3f} MB")


if __name__ == "__main__":
    main()
