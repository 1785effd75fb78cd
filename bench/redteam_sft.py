"""The red-teaming attacker's supervised start, measured: what the tuning costs, what it learned
(held-out log-likelihood of human-written attacks), and the starting attacker's toxicity rate
under the field's evaluation, tuned and untuned.

    python bench/redteam_sft.py                      # the task's supervised start, then 512 × 5
    python bench/redteam_sft.py --sft-steps 0        # the untuned instruct model, 512 × 5
    python bench/redteam_sft.py --attacks 0          # the tuning only (made or found in the cache)

Flags after these are the run's (`python tba.py --help`), e.g. --config recipes/redteam-gflownet.toml.
The tuning is the task's own step (`tasks/redteam_sft.py`), cached: a second call finds it and
reports the record written when it was made. Each result is appended to
bench/results/redteam_sft.jsonl with its commit.
"""
import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import config  # noqa: E402
from devices import placement  # noqa: E402
import tasks  # noqa: E402

RESULTS = REPO / "bench" / "results" / "redteam_sft.jsonl"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--attacks", type=int, default=512, help="attacks sampled for the "
                        "evaluation, 5 victim answers of ≤ 30 tokens each (0: no evaluation)")
    parser.add_argument("--eval-seed", type=int, default=0)
    args, run_flags = parser.parse_known_args(argv)
    if args.attacks < 0:
        parser.error("--attacks must be at least 0")
    try:
        cfg, _, actions = config.parse_args(["--task", "redteam", *run_flags])
        cfg = config.resolve(cfg, recipe=actions["recipe"], recipe_steps=actions["recipe_steps"])
        if cfg.task != "redteam":
            raise ValueError(f"--task {cfg.task}: this measures red-teaming's attacker")
        task = tasks.make_task(cfg)
        task.check_data()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    device = placement.set_up_process(placement.indexed(cfg.device if cfg.device != "auto"
                                                        else "cpu"), placement.usable_cores())
    import torch
    start = time.time()
    model, tokenizer = task.load_model(device)
    record = {"sft_steps": cfg.sft_steps, "load_s": round(time.time() - start, 1),
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                                       capture_output=True, text=True).stdout.strip()}
    folder = Path(model.config._name_or_path)
    if cfg.sft_steps and (folder / "sft.json").is_file():
        record["sft"] = json.loads((folder / "sft.json").read_text())
        record["folder"] = str(folder)
        print(json.dumps(record["sft"], indent=1))
    if args.attacks:
        torch.manual_seed(args.eval_seed)
        start = time.time()
        metrics, samples = task.evaluate_attacker(model, tokenizer, attacks=args.attacks)
        record.update(metrics=metrics, eval_s=round(time.time() - start, 1), samples=samples[:8])
        print(json.dumps(metrics, indent=1), f"\n{record['eval_s']} s")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with open(RESULTS, "a") as f:
        f.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
