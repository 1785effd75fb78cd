"""The final attacker of red-teaming runs, measured as the field measures it.

    python bench/redteam_eval.py runs/redteam-a runs/redteam-b          # 512 attacks each
    python bench/redteam_eval.py RUN --step 75                          # a kept checkpoint's
    python bench/redteam_eval.py RUN --attacks 1024 --device cuda:0     # the GPU recipe's size

GFlowNet red-teaming's code (Lee et al. 2024, GFNOrg/red-teaming) evaluates the trained attacker,
not the search: N attacks sampled at one temperature (T 1 for every method), five victim answers
each; the toxicity rate is the share of attacks whose mean toxicity is above 0.5, diversity is
1 − mean pairwise embedding cosine over all attacks. Stable-GFlowNet counts unique attacks by
clustering the successes greedily at cosine 0.7. This script does all three with the run's own
victim, judge and embedder (`RedTeamTask.evaluate_attacker`, `attacker_metrics`), plus the
diversity of the successes (undefined below two) and unique attacks at 0.5 and 0.9.

Each evaluation is written to RUN/attacker_eval[_stepK].json with its settings; one already there
with the same settings is reported, not run again. A 512-attack evaluation of the CPU recipes'
models (SmolLM2-135M attacker and victim) takes about 13 minutes on one core of an AMD EPYC, most
of it the victim's 2,560 answers. A run's attacker is loaded as it was saved (a LoRA run's folder
holds its adapter and the path of its base), never tuned again.
"""
import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from plumbing import checkpoint  # noqa: E402
import config  # noqa: E402
from devices import placement  # noqa: E402
import tasks  # noqa: E402

REPORTED = ("toxicity_rate", "diversity", "diversity_successes", "unique_0.5", "unique_0.7",
            "unique_0.9", "successes")


def weights_of(run_dir, step):
    """The attacker's folder: the run's final model, or its checkpoint after `step`."""
    folder = (Path(run_dir) / "final" if step is None
              else Path(run_dir) / "checkpoints" / f"step_{step}" / "model")
    if not folder.is_dir():
        raise ValueError(f"{folder} does not exist: pass a finished run, or --step of a kept "
                         "checkpoint")
    return folder


def evaluate(run_dir, args):
    """-> the evaluation's record (read from RUN/attacker_eval*.json when done before)."""
    settings = {"attacks": args.attacks, "answers": args.answers,
                "answer_tokens": args.answer_tokens, "temperature": args.temperature,
                "seed": args.seed, "step": args.step}
    out = Path(run_dir) / ("attacker_eval.json" if args.step is None
                           else f"attacker_eval_step{args.step}.json")
    if out.is_file():
        done = json.loads(out.read_text())
        if done.get("settings") == settings:
            return done
    cfg = config.settings(**config.read_run_config(run_dir))
    if cfg.task != "redteam":
        raise ValueError(f"{run_dir} is a --task {cfg.task} run: this evaluates red-teaming runs")
    folder = weights_of(run_dir, args.step)
    device = placement.set_up_process(placement.indexed(args.device), placement.usable_cores())
    import torch
    torch.manual_seed(args.seed)
    cfg.model, cfg.out = str(folder), ""               # the trained attacker; no samples file
    cfg.sft_steps = 0                                   # it is loaded as it is, never tuned again
    task = tasks.make_task(cfg)
    attacker, tokenizer = task.load_model(device)
    start = time.time()
    metrics, samples = task.evaluate_attacker(     # the attacker at the run's precision, the
        attacker, tokenizer, attacks=args.attacks,  # victim and judge as training scores
        answers=args.answers, answer_tokens=args.answer_tokens, temperature=args.temperature)
    record = {"run": str(run_dir), "weights": str(folder), "settings": settings,
              "seconds": round(time.time() - start, 1), "metrics": metrics,
              "samples": samples[:16]}
    checkpoint.write_file(out, lambda f: f.write(json.dumps(record, indent=1).encode()))
    return record


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", help="red-teaming run folders (runs/<name>)")
    parser.add_argument("--step", type=int, help="evaluate the checkpoint after this step "
                        "(default: the final model)")
    parser.add_argument("--attacks", type=int, default=512, help="N attacks sampled (GPU: 1024)")
    parser.add_argument("--answers", type=int, default=5, help="victim answers per attack")
    parser.add_argument("--answer-tokens", type=int, default=30, help="longest victim answer")
    parser.add_argument("--temperature", type=float, default=1.0, help="the attacker's sampling "
                        "temperature, one for every method")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    for name, low in (("attacks", 1), ("answers", 1), ("answer_tokens", 1)):
        if getattr(args, name) < low:
            parser.error(f"--{name.replace('_', '-')} must be at least {low}")
    if not args.temperature > 0:
        parser.error("--temperature must be greater than 0")
    print("| run | " + " | ".join(REPORTED) + " | s |\n|" + " --- |" * (len(REPORTED) + 2))
    for run_dir in args.runs:
        try:
            record = evaluate(run_dir, args)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        m = record["metrics"]
        cells = [("–" if m[k] is None else f"{m[k]:.3f}" if isinstance(m[k], float) else str(m[k]))
                 for k in REPORTED]
        print(f"| {run_dir} | " + " | ".join(cells) + f" | {record['seconds']} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
