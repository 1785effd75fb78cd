"""TB sync and async against RLOO, or against its own variants, on a real task, several seeds.

    python bench/compare.py redteam   [--seeds 0 1 2] [--settings ...] [--runs DIR] [--plot FILE.png]
    python bench/compare.py summarize [--seeds 0 1 2] [--settings ...] [--runs DIR] [--plot FILE.png]
    python bench/compare.py arith --lanes 2 --settings tb-sync tb-sync-lr3e-5   # 100-step runs

Each setting is `python tba.py --task TASK` with the task's defaults plus a few flags, run with
every seed. Settings:
  tb-sync          --searchers 0   trajectory balance, on-policy
  tb-async         --searchers 1   trajectory balance from a searcher's replay buffer (m = 0.5
                                   for summarize, the paper's best; m = 0.2 and 0.95 beside it)
  rloo-weak-kl     --searchers 0 --loss rloo, β 10× smaller than the task's. RLOO at the task's
                   own β is not run: on one on-policy batch its gradient is (β/2)·K/(K−1) times
                   TB's, so after clipping and Adam it is the same run as tb-sync (weights within
                   3e-6 after 30 red-teaming steps). KL-regularised RL is usually run weaker.
arith runs 100 steps (learning that lasts: does accuracy hold after its best?). tb-sync and
tb-async are today's defaults (β 0.05, commit d83d549); the settings below are the earlier
defaults (β 0.2, written out: BETA_02) and one change each, as the runs in git history had them:
  tb-sync-beta0.2  the earlier default itself
  tb-sync-lr3e-5   --lr 3e-5, the default before lr 1e-5: steps 3x larger
  tb-sync-temp1    --temperature 1: the policy and the reference are the model's softmax at
                   temperature 1, not 0.7 (both sample and score at --temperature): a broader
                   reference, so a broader target, and logits that move the samples 1/0.7
                   times less per step
  tb-sync-ref0.25  --reference-frac 0.25: a quarter of the groups sampled by the frozen
                   reference, which keeps showing the loss what the policy dropped
  tb-sync-decay50  --decay-steps 50: the learning rate falls linearly over the second half of
                   the run instead of the last 10 steps, where the late falls happen
  tb-sync-bf16     --dtype bfloat16: forward passes in bfloat16 autocast, as TRL's GRPOTrainer
                   runs by default (bench/vs_trl.py); the settings above take --dtype auto
                   (float32 unless bfloat16 matmuls time faster on this CPU)
  tb-sync-beta0.05-bf16  β 0.05 (r/β = 20 for a right answer, against 5) in bfloat16: a weaker
                   pull towards the reference, to compare with GRPO's (the runs that made it
                   the default)
  tb-async-beta0.05-bf16  the same with one searcher (--searchers 1)
  tb-sync-eval200, tb-async-eval200  the two above evaluated on all 200 test problems
                   (--eval-n 0), not the first 128: the goal's falls of 5 points are 6-7 of
                   128 problems, within what one evaluation's resolution makes (see the report)
  tb-async-f32, topr-async-f32  one searcher at the defaults in float32 on all 200 problems,
                   with --loss tb and with tb-topr (the stale negatives tapered: bench/lag.py)
summarize runs in bfloat16 (`--dtype bfloat16`: generation 1.4x faster than float32 here).
Runs go seed by seed (so that a stopped bench has every setting for the first seeds), each in its
own process (`--lanes 2`: two at once, each pinned to a core, bench/lag.py's runner); a finished
run in --runs (its last evaluation logged) is not run again, so the script can be stopped and
restarted (an unfinished arith run resumes from its checkpoint of every 10 steps); the trained
models are deleted (the figures are in metrics.jsonl). Then it prints
each metric as mean ± standard deviation over the seeds [min–max] (arith also each run's
evaluations and whether the goal of 100-step learning is met: mean final accuracy ≥ 0.93, every
seed ≥ 0.88, no evaluation after step 25 more than 5 points below the best before it; then
how finely the evaluations resolve a fall: their spread from step 40 against one problem set's
binomial sd, and the chance that a policy steady at their accuracy falls 5 points by chance on
128 and on 200 problems), and `--plot` draws the task's progress metric of every run against
wall time (arith: against step).
"""
import argparse
import json
import math
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from plumbing import plot  # noqa: E402
from lag import finished, largest_fall, run_all, summary  # noqa: E402  the lag bench's runner and report

SYNC, ASYNC = ["--searchers", "0"], ["--searchers", "1"]
BETA_02 = ["--beta", "0.2", "--beta-final", "0.2"]        # arith's default in rounds 8-12
BETA_005_BF16 = ["--dtype", "bfloat16", "--beta", "0.05", "--beta-final", "0.05"]
F32_EVAL200 = ["--dtype", "float32", "--eval-n", "0"]    # where bfloat16 is not native
CHECKPOINTS_S = (120, 240, 360)           # "so far" at these wall times
SUMMARIZE_CHECKPOINTS_S = (240, 360)      # its evaluations come ~3 min apart


def chance_of_fall(accuracy, problems, evaluations, fall):
    """The chance that a policy whose greedy accuracy holds at `accuracy` shows an evaluation more
    than `fall` below the best before it, in `evaluations` evaluations of `problems` problems,
    each problem right with probability `accuracy` at each evaluation, independently: the fall
    that the evaluation's own resolution makes. Exact: a walk over the best count so far."""
    pmf = [math.comb(problems, k) * accuracy ** k * (1 - accuracy) ** (problems - k)
           for k in range(problems + 1)]              # one evaluation's count of right answers
    best = list(pmf)                                  # P(best so far = b, no fall yet)
    for _ in range(evaluations - 1):
        walk = [0.0] * (problems + 1)
        for b, p_best in enumerate(best):
            for k, p_k in enumerate(pmf):
                if b - k <= fall * problems + 1e-9:   # not a fall: the walk goes on
                    walk[max(b, k)] += p_best * p_k
        best = walk
    return 1 - sum(best)


def arith_goal(evals, mean_at_least=0.93, each_at_least=0.88, fall_at_most=0.05, after=25):
    """The goal of 100-step arith runs (learning that lasts), as one line: each part met or not;
    then the resolution of the fall check: the spread of each run's evaluations from step 40
    (learning is over by then) against one problem set's binomial sd at their mean accuracy, and
    the chance that a policy steady at that accuracy falls by chance (`chance_of_fall`), per run
    and in any of the seeds, on these problems and on 200 (arith's whole test split).
    evals: each seed's evaluation rows."""
    finals = [e[-1]["eval/accuracy"] for e in evals]
    falls = [largest_fall(e, "eval/accuracy", after) for e in evals]
    checks = [(f"mean final {statistics.mean(finals):.3f} ≥ {mean_at_least}",
               statistics.mean(finals) >= mean_at_least),
              (f"lowest final {min(finals):.3f} ≥ {each_at_least}", min(finals) >= each_at_least),
              (f"largest fall {max(falls):.3f} ≤ {fall_at_most}", max(falls) <= fall_at_most)]
    line = (f"{len(evals)} seeds: " + "; ".join(f"{text} ({'met' if ok else 'not met'})"
                                                for text, ok in checks))
    steady = [[r["eval/accuracy"] for r in e if r["step"] >= 40] for e in evals]
    if min(map(len, steady)) < 2:
        return line
    accuracy = statistics.mean(a for run in steady for a in run)
    problems, counted = evals[0][-1]["eval/n"], sum(r["step"] > after for r in evals[0])
    chances = {n: chance_of_fall(accuracy, n, counted, fall_at_most) for n in (problems, 200)}
    return (line + f"\n  resolution: evaluations from step 40 spread by sd "
            f"{statistics.mean(statistics.stdev(run) for run in steady):.3f} (mean over runs) "
            f"about their mean {accuracy:.3f}; one evaluation of {problems} problems at that "
            f"accuracy: sd {math.sqrt(accuracy * (1 - accuracy) / problems):.3f}. A policy "
            f"steady at {accuracy:.3f} falls more than {fall_at_most} below its best in "
            f"{counted} evaluations by chance alone in "
            + ", ".join(f"{chances[n]:.0%} of runs on {n} problems "
                        f"({1 - (1 - chances[n]) ** len(evals):.0%} of {len(evals)} seeds)"
                        for n in chances))


def at_step(rows, step):
    return next(r for r in rows if r["step"] == step)


def last_mean(rows, key, n):
    return statistics.mean(r[key] for r in rows[-n:])


def last_before(rows, key, seconds):
    """The last value of `key` logged by `seconds` of wall time (0 before the first)."""
    rows = [r for r in rows if r["time"] <= seconds and key in r]
    return rows[-1][key] if rows else 0


TASKS = {
    "arith": dict(
        common=["--steps", "100"], save_every=10,      # a run stopped part-way resumes
        settings={"tb-sync": SYNC, "tb-async": ASYNC, "tb-sync-beta0.2": [*SYNC, *BETA_02],
                  "tb-sync-lr3e-5": [*SYNC, *BETA_02, "--lr", "3e-5"],
                  "tb-sync-temp1": [*SYNC, *BETA_02, "--temperature", "1.0"],
                  "tb-sync-ref0.25": [*SYNC, *BETA_02, "--reference-frac", "0.25"],
                  "tb-sync-decay50": [*SYNC, *BETA_02, "--decay-steps", "50"],
                  "tb-sync-bf16": [*SYNC, *BETA_02, "--dtype", "bfloat16"],
                  "tb-sync-beta0.05-bf16": [*SYNC, *BETA_005_BF16],
                  "tb-async-beta0.05-bf16": [*ASYNC, *BETA_005_BF16],
                  "tb-sync-eval200": [*SYNC, *BETA_005_BF16, "--eval-n", "0"],
                  "tb-async-eval200": [*ASYNC, *BETA_005_BF16, "--eval-n", "0"],
                  "tb-async-f32": [*ASYNC, *F32_EVAL200, "--loss", "tb"],
                  "topr-async-f32": [*ASYNC, *F32_EVAL200, "--loss", "tb-topr"]},
        columns={"acc10": ("accuracy at step 10", 3, lambda t, e: at_step(e, 10)["eval/accuracy"]),
                 "best": ("best accuracy", 3, lambda t, e: max(r["eval/accuracy"] for r in e)),
                 "final": ("final accuracy", 3, lambda t, e: e[-1]["eval/accuracy"]),
                 "fall": ("largest fall after step 25 below the best so far", 3,
                          lambda t, e: largest_fall(e, "eval/accuracy", 25)),
                 "kl": ("KL, last 10 steps", 2, lambda t, e: last_mean(t, "kl", 10)),
                 "logp": ("log π of the samples, last 10", 2, lambda t, e: last_mean(t, "logp_mean", 10)),
                 "equal": ("groups of equal rewards, last 10", 2,
                           lambda t, e: last_mean(t, "equal_reward_frac", 10)),
                 "staleness": ("staleness (steps), mean", 2,
                               lambda t, e: statistics.mean(r["staleness_mean"] for r in t))},
        curve=("eval", "eval/accuracy", "greedy accuracy"), curve_x="step",
        goal=arith_goal),
    "redteam": dict(
        settings={"tb-sync": SYNC, "tb-async": ASYNC,
                  "rloo-weak-kl": [*SYNC, "--loss", "rloo", "--beta", "0.01", "--beta-final", "0.01"]},
        # name -> (column header, digits, value from (training rows, evaluation rows))
        columns={"success_rate": ("eval success rate", 3, lambda t, e: e[-1]["eval/success_rate"]),
                 "diversity": ("eval diversity of successes", 3, lambda t, e: e[-1].get("eval/diversity")),
                 "eval_unique": ("eval distinct successes (of 32)", 1,
                                 lambda t, e: e[-1]["eval/unique_successes"]),
                 **{f"found_{s}s": (f"found by {s // 60} min", 1, lambda t, e, s=s: last_before(
                     t, "redteam/unique_successes", s)) for s in CHECKPOINTS_S},
                 "found": ("found in the run", 1, lambda t, e: t[-1]["redteam/unique_successes"]),
                 "wall": ("wall (s)", 0, lambda t, e: e[-1]["time"])},
        curve=("train", "redteam/unique_successes", "distinct successful attacks found")),
    "summarize": dict(
        common=["--dtype", "bfloat16"],          # see the docstring
        settings={"tb-sync": SYNC, "tb-async": ASYNC,
                  "rloo-weak-kl": [*SYNC, "--loss", "rloo", "--beta", "0.002", "--beta-final", "0.002"],
                  "tb-async-m0.2": [*ASYNC, "--recent-frac", "0.2"],
                  "tb-async-m0.95": [*ASYNC, "--recent-frac", "0.95"]},
        columns={"win_rate": ("eval win rate (end)", 3, lambda t, e: e[-1]["eval/win_rate"]),
                 "kl": ("eval KL (end, nats)", 2, lambda t, e: e[-1]["eval/kl"]),
                 "reward": ("eval reward (end)", 3, lambda t, e: e[-1]["eval/reward_mean"]),
                 "reward_gain": ("eval reward: gain from step 0", 3,
                                 lambda t, e: e[-1]["eval/reward_mean"] - e[0]["eval/reward_mean"]),
                 "greedy_win_rate": ("greedy win rate (end)", 3,
                                     lambda t, e: e[-1]["eval/greedy_win_rate"]),
                 "train_reward": ("train reward, last 3 steps", 3,
                                  lambda t, e: statistics.mean(r["reward_mean"] for r in t[-3:])),
                 **{f"win_{s}s": (f"win rate by {s // 60} min", 3, lambda t, e, s=s: last_before(
                     e, "eval/win_rate", s)) for s in SUMMARIZE_CHECKPOINTS_S},
                 "staleness": ("staleness (steps)", 1,
                               lambda t, e: statistics.mean(r["staleness_mean"] for r in t)),
                 "generated": ("groups generated", 0, lambda t, e: t[-1]["gen_groups"]),
                 "wall": ("wall (s)", 0, lambda t, e: e[-1]["time"])},
        curve=("eval", "eval/win_rate", "eval win rate")),
}


def done(out):
    """A run whose last evaluation (at the step its config.json says it ends) is logged."""
    config = out / "config.json"
    return config.is_file() and finished(out, json.loads(config.read_text())["config"]["steps"])


def draw(task, runs, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows_kind, key, label = TASKS[task]["curve"]
    x = TASKS[task].get("curve_x", "time")
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for i, (setting, outs) in enumerate(runs.items()):
        for j, out in enumerate(outs):
            train_rows, eval_rows = plot.read_metrics(out)
            rows = train_rows if rows_kind == "train" else eval_rows
            ax.plot([r[x] for r in rows], [r[key] for r in rows], color=f"C{i}",
                    label=setting if j == 0 else None, linewidth=1.2,
                    marker="o" if rows_kind == "eval" else None, markersize=3)
    ax.set_xlabel("wall time (s)" if x == "time" else x)
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("task", choices=TASKS)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--settings", nargs="+", default=None,
                        help="default: every setting of the task")
    parser.add_argument("--runs", default="", help="folder for the runs (default runs/bench-TASK)")
    parser.add_argument("--plot", default="", help="write the progress-over-time plot here (.png)")
    parser.add_argument("--lanes", type=int, choices=(1, 2), default=1,
                        help="runs at once (2: each pinned to one core)")
    parser.add_argument("--report-only", action="store_true",
                        help="no runs: the table (and plot) of the finished ones")
    args = parser.parse_args()
    spec = TASKS[args.task]
    settings = args.settings or list(spec["settings"])
    unknown = [s for s in settings if s not in spec["settings"]]
    if unknown:
        parser.error(f"{args.task} has no setting {unknown[0]}: pick from {', '.join(spec['settings'])}")
    folder = Path(args.runs or f"runs/bench-{args.task}")
    runs = {s: [folder / f"{s}-s{seed}" for seed in args.seeds] for s in settings}
    todo = [(["--task", args.task, *spec.get("common", []), *spec["settings"][setting],
              "--seed", str(seed)], outs[i])
            for i, seed in enumerate(args.seeds) for setting, outs in runs.items() if not done(outs[i])]
    run_all([] if args.report_only else todo, args.lanes, save_every=spec.get("save_every", 0))
    runs = {setting: [out for out in outs if done(out)] for setting, outs in runs.items()}
    columns = spec["columns"].values()
    print(f"| setting (seeds {' '.join(map(str, args.seeds))}) | "
          + " | ".join(c[0] for c in columns) + " |\n|" + " --- |" * (len(columns) + 1))
    for setting, outs in runs.items():
        data = [plot.read_metrics(out) for out in outs]
        if data:
            print(f"| {setting} | " + " | ".join(      # a value a run does not define is left out
                summary([v for t, e in data if (v := value(t, e)) is not None], digits)
                for _, digits, value in columns) + " |")
    finished_runs = [out for outs in runs.values() for out in outs]
    if spec["curve"][0] == "eval" and finished_runs:    # each run's evaluations, step by step
        key, steps = spec["curve"][1], [r["step"] for r in plot.read_metrics(finished_runs[0])[1]]
        print(f"\n| run | {key} at steps {', '.join(map(str, steps))} |\n| --- | --- |")
        for out in finished_runs:
            evals = plot.read_metrics(out)[1]
            print(f"| {out.name} | " + ", ".join(f"{r[key]:.3f}" for r in evals) + " |")
    if "goal" in spec:
        for setting, outs in runs.items():
            if outs:
                evals = [plot.read_metrics(out)[1] for out in outs]
                print(f"\ngoal, {setting}: {spec['goal'](evals)}")
    if args.plot:
        draw(args.task, runs, args.plot)
        print(f"\n{args.plot}")


if __name__ == "__main__":
    main()
