"""Accuracy against staleness: trajectory balance and off-policy RLOO at an exact policy lag.

    python bench/lag.py arith --reuse runs/bench-arith   # TB, RLOO+IS, VCPO at L = 0 4 16
    python bench/lag.py toy                   # TB, RLOO, RLOO+IS, VCPO at L = 0 32 128
    python bench/lag.py arith --lanes 2       # two runs at a time, each pinned to its own core
    python bench/lag.py arith --report-only   # the table and the plot of what has finished
    python bench/lag.py arith --steps 25      # shorter runs, in runs/bench-lag-arith-25
    python bench/lag.py arith --dtype float32 # as the float32 runs before it, on any machine

Every run is `python tba.py --task TASK --lag L --loss LOSS --seed S` plus the task's flags
below: the synchronous loop, whose groups are sampled by the policy as it was exactly L updates
earlier (`sources.SynchronousSource`). Prompts, seeds and everything else are the same at every L, so
the table shows what staleness alone costs each loss, free of replay and of process timing.
  tb        trajectory balance (`trainer.tb_loss`)
  rloo      REINFORCE leave-one-out on the KL-regularised reward, no correction
  rloo-is   the same, each completion weighted by min(π/μ, 2) (`rloo.truncated_is_weights`)
  vcpo      rloo-is with each step's learning rate times √(ESS/N) (`staleness.ess_step_scale`)
arith runs at the task's defaults (100 steps, lr 1e-5, β 0.05: RESULTS' staleness grid, with
--dtype bfloat16; a grid at the earlier β 0.2 is in commit a537a91), so that a lag
is small against the run: TB at L = 0 is then bench/compare.py's `tb-sync` run (the same
command), and `--reuse runs/bench-arith` copies those in instead of running them again (a
bench/vs_trl.py folder's `tba-sync` runs too, with `--steps` and flags to match). A 25-step
grid at β 0.05 is in commit 8a89dd2.

Runs go in the order of LOSSES × LAGS seed by seed, the largest lag first (a stopped bench has
the figures that matter most); a finished run (its metrics hold the last step's evaluation) is
skipped, an unfinished one started again (arith: resumed from its checkpoint of every 10
steps). --lanes 2 runs two at once, each with `taskset` on one core (tba then uses one thread).
The trained models are deleted after each run, the checkpoints and --lag's weight files after
each run that ends well (the figures are in metrics.jsonl). The report gives the final metric,
the mean of the last 3 evaluations, the largest fall after step 25, the metric at each
evaluation, the mean ESS/N and log π/μ of the trained data and the final KL, each as
mean ± sd [min–max] over the seeds, and names the evaluations a run is missing; then each loss
against TB at its own lag and at L = 0, seed by seed (a win over TB: ahead on every seed by more
than the larger sd); and draws final metric against lag, a line per loss through the seeds'
mean and a dot per seed (settings with every seed finished only), and beside it the metric
against step, a line per loss and lag.
"""
import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

TASKS = {
    "arith": dict(flags=["--eval-n", "0"],                 # all 200 test problems
                  losses=("tb", "tb-trust", "tb-topr", "tb-is", "tb-ess", "tb-topr-ess",
                          "rloo-is", "vcpo"),
                  lags=(16, 4, 0), metric="eval/accuracy",
                  better="higher", save_every=10),    # ~70 min a run: a stopped one resumes
    "toy": dict(flags=[], losses=("tb", "rloo", "rloo-is", "vcpo"), lags=(128, 32, 0),
                metric="toy/tv", better="lower"),
}


def folder(runs, loss, lag, seed):
    return runs / f"{loss}-L{lag}-s{seed}"


def read(run_dir):
    """(training rows, evaluation rows) of a run's metrics.jsonl."""
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    return [r for r in rows if "loss" in r], [r for r in rows if "loss" not in r]


def finished(run_dir, steps):
    if not (run_dir / "metrics.jsonl").is_file():
        return False
    train, evals = read(run_dir)
    return bool(evals) and evals[-1]["step"] == steps and len(train) == steps


def flags(task, setting, lag, seed, steps, dtype="auto"):
    """A setting is a --loss, or LOSS@LR: that loss at learning rate LR (e.g. tb@6e-6)."""
    loss, _, lr = setting.partition("@")
    uncorrected = ["--rloo-off-policy"] if loss == "rloo" else []    # on stale data, as asked
    return ["--task", task, "--searchers", "0", "--lag", str(lag), "--loss", loss, "--seed",
            str(seed), "--steps", str(steps), "--dtype", dtype, *uncorrected,
            *(["--lr", lr] if lr else []), *TASKS[task]["flags"]]


def run_all(todo, lanes, save_every=0):
    """Run `python tba.py FLAGS --out OUT` for each (FLAGS, OUT) of `todo`, `lanes` at a time
    (each on its own core with `taskset` when 2). With `save_every` 0, no checkpoints and an
    unfinished run starts again; else a checkpoint every `save_every` steps (the newest kept),
    and a run stopped part-way resumes from it (`tba.py --resume`: a synchronous run resumed
    is the run that never stopped). The trained model is deleted when a run ends; the
    checkpoints and --lag's weight files when it ends well (a failed run can resume from them).
    Also used by bench/explore.py and bench/compare.py."""
    todo, running = list(todo), {}                     # lane -> (Popen, out, log)
    while todo or running:
        for lane in range(lanes):
            if lane not in running and todo:
                run_flags, out = todo.pop(0)
                resume = save_every and any((out / "checkpoints").glob("step_*"))
                if not resume:
                    shutil.rmtree(out, ignore_errors=True)
                    out.mkdir(parents=True)
                log = open(out.parent / f"{out.name}.log", "a" if resume else "w")
                print(("resume " if resume else "start ") + out.name
                      + (f" on core {lane}" if lanes > 1 else ""), flush=True)
                pin = ["taskset", "-c", str(lane)] if lanes > 1 else []
                what = ["--resume", str(out)] if resume else [*run_flags, "--out", str(out)]
                running[lane] = (subprocess.Popen(
                    [*pin, sys.executable, "tba.py", *what, "--save-every", str(save_every),
                     "--keep-checkpoints", "1", "--device", "cpu", "--quiet"],
                    cwd=REPO, stdout=log, stderr=subprocess.STDOUT), out, log)
        time.sleep(2)
        for lane, (proc, out, log) in list(running.items()):
            if proc.poll() is not None:
                log.close()
                del running[lane]
                print(f"done {out.name}: exit {proc.returncode}", flush=True)
                # The model goes; the checkpoints and --lag's old weights once nothing is to resume.
                for kept in ("final", *(("lag", "checkpoints") if proc.returncode == 0 else ())):
                    shutil.rmtree(out / kept, ignore_errors=True)


def summary(values, digits=3):
    if not values:
        return "–"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return (f"{statistics.mean(values):.{digits}f} ± {sd:.{digits}f} "
            f"[{min(values):.{digits}f}–{max(values):.{digits}f}] (n={len(values)})")


DIAGNOSTICS = ("grad_norm", "grad_cos_prev", "low_ratio_share", "log_ratio_rewarded",
               "log_ratio_unrewarded", "reward_mean")


def largest_fall(evals, key, after):
    """The most an evaluation after step `after` lies below the best one before it (0: none).
    Also used by bench/compare.py."""
    best, fall = -float("inf"), 0.0
    for e in evals:
        if e["step"] > after:
            fall = max(fall, best - e[key])
        best = max(best, e[key])
    return fall


def missing_evaluations(steps):
    """The steps of a run's evaluations that are absent: its evaluations are every k steps, k the
    smallest gap between two of them (the last, at the final step, may be closer)."""
    every = min((b - a for a, b in zip(steps, steps[1:-1])), default=0)
    return [s for s in range(steps[0], steps[-1], every) if s not in steps] if every else []


def report(task, runs, seeds, steps, plot_to):
    spec, metric = TASKS[task], TASKS[task]["metric"]
    print(f"\n{task}: {metric} ({spec['better']} is better), {len(seeds)} seeds; "
          f"flags {' '.join(spec['flags']) or '(task defaults)'}\n")
    sign = 1 if spec["better"] == "higher" else -1      # a fall is a step the wrong way
    print(f"| loss | L | final {metric} | mean of the last 3 evaluations | largest fall after "
          f"step 25 | by evaluation (step: mean) | ESS/N | log π/μ | final KL |")
    print("|---|---|---|---|---|---|---|---|---|")
    why = []                       # the diagnostics of each setting: means over steps and seeds
    gaps = []                      # evaluations a run is missing (stopped while it evaluated)
    finals, curves, by_seed = {}, {}, {}
    for loss in spec["losses"]:
        for lag in sorted(spec["lags"]):
            done = [s for s in seeds if finished(folder(runs, loss, lag, s), steps)]
            if not done:
                continue
            data = [read(folder(runs, loss, lag, s)) for s in done]
            gaps += [f"{loss} at L = {lag}, seed {seed}: step {', '.join(map(str, missing))}"
                     for seed, (_, evals) in zip(done, data)
                     if (missing := missing_evaluations([e["step"] for e in evals]))]
            final = [e[-1][metric] for _, e in data]
            finals[(loss, lag)] = final
            by_seed[(loss, lag)] = dict(zip(done, final))
            by_step = {}
            for _, evals in data:
                for e in evals:
                    by_step.setdefault(e["step"], []).append(e[metric])
            curves[(loss, lag)] = {s: statistics.mean(v) for s, v in sorted(by_step.items())}
            curve = " ".join(f"{s}: {v:.3f}" for s, v in curves[(loss, lag)].items())
            ess = [statistics.mean(r["ess_frac"] for r in t) for t, _ in data if "ess_frac" in t[0]]
            ratio = [statistics.mean(r["log_ratio_mean"] for r in t) for t, _ in data
                     if "log_ratio_mean" in t[0]]
            kl = [t[-1]["kl"] for t, _ in data]
            last3 = [statistics.mean(e[metric] for e in evals[-3:]) for _, evals in data]
            fall = [largest_fall([{**e, metric: sign * e[metric]} for e in evals], metric,
                                 after=25) for _, evals in data]
            print(f"| {loss} | {lag} | {summary(final)} | {summary(last3)} | {summary(fall)} | "
                  f"{curve} | {summary(ess)} | {summary(ratio)} | {summary(kl)} |")
            why.append((loss, lag, [[statistics.mean(r[k] for r in t if k in r) if any(
                k in r for r in t) else None for t, _ in data] for k in DIAGNOSTICS]))
    if gaps:
        print("\nMissing evaluations (the means by evaluation leave those seeds out there, and a "
              "fall there is not counted): " + "; ".join(gaps))
    against_tb(by_seed, sign)
    print("\nWhy (means over each run's steps, then over seeds): the pre-clip gradient norm, the "
          "cosine between consecutive gradients, the share of TB's per-completion weight on "
          "completions with π/μ < e^-2, the mean log π/μ of completions rewarded above and "
          "below their group's mean, the mean reward\n")
    print("| loss | L | " + " | ".join(DIAGNOSTICS) + " |")
    print("|---|---|" + "---|" * len(DIAGNOSTICS))
    for loss, lag, columns in why:
        print(f"| {loss} | {lag} | " + " | ".join(
            summary([v for v in column if v is not None]) for column in columns) + " |")
    if plot_to and finals:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, (ax, by_step_ax) = plt.subplots(1, 2, figsize=(10, 3.5))
        color = {loss: f"C{i}" for i, loss in enumerate(spec["losses"])}   # a loss: one colour
        for loss in spec["losses"]:
            points = sorted((lag, v) for (lo, lag), v in finals.items()
                            if lo == loss and len(v) == len(seeds))     # complete settings only
            if points:                   # the mean as a line, every seed as a dot
                ax.plot([lag for lag, _ in points], [statistics.mean(v) for _, v in points],
                        marker="o", label=loss, color=color[loss])
                ax.scatter([lag for lag, v in points for _ in v], [x for _, v in points for x in v],
                           color=color[loss], alpha=0.4, s=14)
        styles = dict(zip(sorted(spec["lags"]), ("-", "--", ":", "-.")))   # a lag: one style
        for (loss, lag), curve in curves.items():   # the mean over the finished seeds
            by_step_ax.plot(list(curve), list(curve.values()), marker=".", color=color[loss],
                            linestyle=styles.get(lag, "-"), label=f"{loss}, L = {lag}")
        ax.set_xlabel("policy lag L (updates)")
        ax.set_ylabel(f"final {metric}")
        ax.set_title(f"{task}: mean over {len(seeds)} seeds (dots: each seed)")
        ax.legend()
        by_step_ax.set_xlabel("step")
        by_step_ax.set_ylabel(metric)
        by_step_ax.set_title("by evaluation, mean over the finished seeds")
        by_step_ax.legend(fontsize=7, handlelength=4)   # long enough to show a dash
        fig.tight_layout()
        fig.savefig(plot_to, dpi=120)
        print(f"\nplot: {plot_to}")


def against_tb(by_seed, sign):
    """Each loss against TB at its own lag and at L = 0, on the seeds both finished. A win over
    TB is being ahead on every seed by more than the larger of the two sds (one value a seed: the
    final metric, `sign` +1 when higher is better); the gap to TB at L = 0 is that of the means
    and that of the worst seeds."""
    rows = []
    for (loss, lag), mine in by_seed.items():
        for name, other in (("tb", by_seed.get(("tb", lag))),
                            ("tb at L = 0", by_seed.get(("tb", 0)))):
            common = sorted(set(mine) & set(other or {}))
            if loss == "tb" and name == "tb" or not common or (loss, lag) == ("tb", 0):
                continue
            a, b = [mine[s] for s in common], [other[s] for s in common]
            ahead = [sign * (x - y) for x, y in zip(a, b)]                      # per seed
            sd = max(statistics.stdev(v) if len(v) > 1 else 0.0 for v in (a, b))
            win = "–" if name != "tb" else "yes" if len(common) > 1 and min(ahead) > sd else "no"
            worst = sign * (min(a, key=lambda v: sign * v) - min(b, key=lambda v: sign * v))
            rows.append(f"| {loss} | {lag} | {name} | {' '.join(str(s) for s in common)} | "
                        f"{' '.join(f'{d:+.3f}' for d in ahead)} | {sd:.3f} | "
                        f"{win} | "
                        f"{sign * (statistics.mean(a) - statistics.mean(b)):+.3f} | {worst:+.3f} |")
    if rows:
        print("\nAgainst TB (final metric; ahead: this loss minus the other, per seed, positive "
              "when better; win: ahead on every seed, more than one, by more than the larger sd)\n")
        print("| loss | L | against | seeds | ahead, per seed | larger sd | win | mean ahead | "
              "worst seed ahead |")
        print("|---|---|---|---|---|---|---|---|---|")
        print("\n".join(rows))


def plot_why(task, runs, seeds, steps, plot_to, window=5):
    """Per setting with a finished run, the diagnostics against step (a moving mean over
    `window` steps, the first seed's run): the cosine between consecutive gradients, the
    share of TB's weight on completions with π/μ < e⁻², the mean log π/μ of rewarded and
    unrewarded completions, and the reward of the sampler μ against that of the policy π being
    trained. With an exact lag L, π's own samples are the groups it draws for step t + L, so
    π's reward at step t is the batch reward logged at step t + L: no extra sampling."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    spec = TASKS[task]
    panels = [("grad_cos_prev", "cosine of consecutive gradients"),
              ("low_ratio_share", "share of TB's weight, π/μ < e⁻²"),
              ("log_ratio", "mean log π/μ: rewarded (—), unrewarded (- -)"),
              ("reward", "reward: μ's batches (—), π's own (- -)")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.4))
    smooth = lambda xs: [statistics.mean(xs[max(0, i - window + 1):i + 1]) for i in range(len(xs))]
    for i, (loss, lag) in enumerate((lo, la) for lo in spec["losses"] for la in sorted(spec["lags"])):
        run = next((folder(runs, loss, lag, s) for s in seeds
                    if finished(folder(runs, loss, lag, s), steps)), None)
        if run is None:
            continue
        rows, color, label = read(run)[0], f"C{i}", f"{loss}, L = {lag}"
        step = [r["step"] for r in rows]
        for ax, (key, title) in zip(axes, panels):
            if key == "log_ratio":
                for name, style in (("log_ratio_rewarded", "-"), ("log_ratio_unrewarded", "--")):
                    have = [(r["step"], r[name]) for r in rows if name in r]
                    if have:
                        ax.plot([a for a, _ in have], smooth([b for _, b in have]), style,
                                color=color, label=label if style == "-" else None)
            elif key == "reward":
                reward = [r["reward_mean"] for r in rows]
                ax.plot(step, smooth(reward), "-", color=color, label=label)
                if lag:                                       # π_t sampled step t + L's groups
                    ax.plot(step[:-lag], smooth(reward[lag:]), "--", color=color)
            else:
                have = [(r["step"], r[key]) for r in rows if key in r]
                if have:
                    ax.plot([a for a, _ in have], smooth([b for _, b in have]), color=color,
                            label=label)
            ax.set_title(title, fontsize=9)
            ax.set_xlabel("step")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{task}: why stale data hurts (moving mean over {window} steps, seed {seeds[0]})",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(plot_to, dpi=120)
    print(f"plot: {plot_to}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("task", choices=sorted(TASKS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--lags", type=int, nargs="+", help="default: the task's")
    parser.add_argument("--losses", nargs="+", help="default: the task's; LOSS@LR runs LOSS at "
                        "learning rate LR (e.g. tb@6e-6 tb-trust:4@1e-5)")
    parser.add_argument("--lanes", type=int, default=1, choices=(1, 2))
    parser.add_argument("--runs", type=Path, help="default: runs/bench-lag-TASK, with "
                        "-STEPS when --steps is given")
    parser.add_argument("--steps", type=int, help="trainer steps of every run (default: the "
                        "task's; its schedule's warm-up and decay stay as they are)")
    parser.add_argument("--reuse", type=Path, help="arith: a bench/compare.py folder whose "
                        "tb-sync-sN runs (or a bench/vs_trl.py one whose tba-sync-sN runs) are "
                        "TB at L = 0: the same command")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                        help="every run's --dtype: float32 to extend a grid run on a machine "
                        "without native bfloat16 (auto picks bfloat16 where it is faster)")
    parser.add_argument("--plot", type=Path, help="PNG of final metric against lag")
    parser.add_argument("--plot-why", type=Path, help="PNG of the diagnostics against step")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args(argv)
    spec = TASKS[args.task]
    spec["lags"] = tuple(args.lags or spec["lags"])
    spec["losses"] = tuple(args.losses or spec["losses"])
    sys.path.insert(0, str(REPO))
    import tasks
    steps = args.steps or tasks.task_class(args.task).defaults["steps"]
    runs = args.runs or REPO / "runs" / (f"bench-lag-{args.task}"
                                         + (f"-{steps}" if args.steps else ""))
    if args.reuse:
        for seed in args.seeds:
            target = folder(runs, "tb", 0, seed)
            source = next((args.reuse / f"{name}-s{seed}" for name in ("tb-sync", "tba-sync")
                           if finished(args.reuse / f"{name}-s{seed}", steps)), None)
            if source and not finished(target, steps):
                shutil.copytree(source, target, dirs_exist_ok=True)
    todo = [(flags(args.task, loss, lag, seed, steps, args.dtype), folder(runs, loss, lag, seed))
            for lag in spec["lags"] for seed in args.seeds for loss in spec["losses"]]
    todo = [t for t in todo if not finished(t[1], steps)]
    if not args.report_only:
        run_all(todo, args.lanes, save_every=spec.get("save_every", 0))
    report(args.task, runs, args.seeds, steps, args.plot)
    if args.plot_why:
        plot_why(args.task, runs, args.seeds, steps, args.plot_why)


if __name__ == "__main__":
    main()
