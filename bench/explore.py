"""Exploration: what searchers that sample from other distributions than the policy buy.

    python bench/explore.py toy                  # the toy settings below, seeds 0 1 2
    python bench/explore.py redteam --lanes 2    # two runs at a time, each pinned to its own core
    python bench/explore.py toy --report-only    # the table of what has finished
    python bench/explore.py redteam --steps 150 --report-only --plot found.png   # and the curves
    python bench/explore.py redteam --steps 150 --report-only --frontier frontier.png  # over β

Every run is `python tba.py --task TASK --seed S` plus a setting's flags. Toy (exact: final
toy/tv, lower is better, and toy/modes, the modes of six where the policy holds at least half
the target's mass), at a fixed β = 0.07, where on-policy sampling loses modes, and at the
task's annealed default:
  tb                 on-policy trajectory balance, the synchronous loop
  tb-explore         the same loop, each group sampled at a temperature drawn from [1, 2] and
                     a quarter of the groups by the frozen reference model
  tb-explore-replay  one searcher exploring so; half of each batch from the newest groups,
                     half replayed by reward (--recent-frac 0.5 --priority-temp 0.25, as
                     GFlowNet red-teaming's 50/50), each completion stored once (--dedup)
  tb-explore-async, -half-replay, -half-priority   what of that replay costs accuracy: one
                     exploring searcher with fresh data only (m 0.95), then half replayed
                     uniformly, then half by reward (no dedup)
  rloo               on-policy RLOO, synchronous
  rloo-explore       RLOO on the explorative groups, uncorrected (--rloo-off-policy): at one β
                     its update is TB's up to a constant factor, on any batch
  rloo-is-explore    RLOO with truncated importance weights on the explorative groups
Red-teaming (final evaluation, and the distinct successful attacks among all generated), all at
β 0.01, on-policy RLOO's strongest setting measured before (RESULTS.md), so that exploration is
the only difference (on-policy TB at one β is the same run as RLOO):
  rloo               on-policy RLOO, synchronous
  tb-explore         the synchronous loop, each group at a temperature drawn from [0.7, 1.4]
                     (the task samples at 0.7; GFlowNet red-teaming draws from [0.5, 2] at 1)
  tb-explore-replay  one searcher exploring so; half of each batch replayed by reward
                     (--priority-temp 1 on the mean log-toxicity), near-duplicate attacks
                     (cosine >= 0.9, the task's own threshold for a distinct success) merged
  tb-keep-best       one searcher, no hotter sampling, the buffer of completions as GFlowNet
                     red-teaming keeps it: the lowest reward evicted first (at most 100 attacks
                     of a prompt), each attack once, near-duplicates merged keeping the better,
                     half of each batch replayed by reward
  tb-keep-best-explore  the same, sampling each group at a temperature in [0.7, 1.4]
  tb-sync-keep-best  that buffer without a searcher process: each step samples 2 of its 4
                     groups fresh from the policy and replays 2 from the buffer (--replay-groups)
  beta-0.1/...       RLOO, tb-keep-best-explore and tb-sync-keep-best at the task's β 0.1:
                     the diversity–success frontier's second point

A finished run (its last evaluation is at the last step) is skipped, an unfinished one started
again (with --steps, resumed from its checkpoint of every 10 steps); `--lanes 2` runs two at
once with `taskset`, one core each (a one-searcher run then has its trainer and searcher share
that core). Trained models are deleted after each run.
"""
import argparse
import statistics
import sys
from pathlib import Path

from lag import finished, read, run_all, summary     # the lag bench's runner and report

REPO = Path(__file__).resolve().parents[1]
FIXED_BETA = ["--beta", "0.07", "--beta-final", "0.07", "--beta-steps", "0"]
EXPLORE = ["--search-temperature", "1", "2", "--reference-frac", "0.25"]
REPLAY = ["--searchers", "1", "--recent-frac", "0.5", "--priority-temp", "0.25", "--dedup",
          "--max-reuse", "0"]
WEAK_KL = ["--beta", "0.01", "--beta-final", "0.01"]    # red-teaming: RLOO's best β measured
# The buffer of completions at its GFlowNet red-teaming settings: replay by reward; the lowest
# reward evicted first; each attack stored once, near-duplicates merged keeping the better one.
BEST_KEPT = ["--priority-temp", "1", "--buffer-evict", "lowest", "--buffer-per-prompt", "100",
             "--dedup", "--merge-cosine", "0.9", "--max-reuse", "0"]
# ... filled by a searcher process, half of each batch drawn from its newest weights' attacks;
KEEP_BEST = ["--searchers", "1", "--recent-frac", "0.5", *BEST_KEPT]
# ... or without one, as GFlowNet red-teaming trains: each step samples half its groups fresh
# from the policy and replays the other half.
SYNC_KEEP_BEST = ["--searchers", "0", "--replay-groups", "2", *BEST_KEPT]
SETTINGS = {
    "toy": {
        "fixed/tb": [*FIXED_BETA, "--searchers", "0"],
        "fixed/tb-explore": [*FIXED_BETA, "--searchers", "0", *EXPLORE],
        "fixed/tb-explore-replay": [*FIXED_BETA, *EXPLORE, *REPLAY],
        # which part of the replay costs accuracy: one searcher exploring, fresh data only
        # (m 0.95, the default), then half replayed uniformly, then by reward
        "fixed/tb-explore-async": [*FIXED_BETA, *EXPLORE, "--searchers", "1"],
        "fixed/tb-explore-half-replay": [*FIXED_BETA, *EXPLORE, "--searchers", "1",
                                         "--recent-frac", "0.5"],
        "fixed/tb-explore-half-priority": [*FIXED_BETA, *EXPLORE, "--searchers", "1",
                                           "--recent-frac", "0.5", "--priority-temp", "0.25"],
        "fixed/rloo": [*FIXED_BETA, "--searchers", "0", "--loss", "rloo"],
        "fixed/rloo-explore": [*FIXED_BETA, "--searchers", "0", "--loss", "rloo",
                               "--rloo-off-policy", *EXPLORE],
        "fixed/rloo-is-explore": [*FIXED_BETA, "--searchers", "0", "--loss", "rloo-is", *EXPLORE],
        "annealed/tb": ["--searchers", "0"],
        "annealed/tb-explore": ["--searchers", "0", *EXPLORE],
    },
    "redteam": {
        "rloo": ["--searchers", "0", "--loss", "rloo", *WEAK_KL],
        "tb-explore": ["--searchers", "0", *WEAK_KL, "--search-temperature", "0.7", "1.4"],
        "tb-explore-replay": ["--searchers", "1", *WEAK_KL, "--search-temperature", "0.7", "1.4",
                              "--recent-frac", "0.5", "--priority-temp", "1",
                              "--merge-cosine", "0.9", "--max-reuse", "0"],
        "tb-keep-best": [*WEAK_KL, *KEEP_BEST],
        "tb-keep-best-explore": [*WEAK_KL, *KEEP_BEST, "--search-temperature", "0.7", "1.4"],
        "tb-sync-keep-best": [*WEAK_KL, *SYNC_KEEP_BEST],
        "beta-0.1/rloo": ["--searchers", "0", "--loss", "rloo"],
        "beta-0.1/tb-keep-best-explore": [*KEEP_BEST, "--search-temperature", "0.7", "1.4"],
        "beta-0.1/tb-sync-keep-best": SYNC_KEEP_BEST,
    },
}
METRICS = {"toy": ("toy/tv", "toy/modes"),
           "redteam": ("eval/success_rate", "eval/diversity", "redteam/unique_successes")}


def folder(runs, setting, seed):
    return runs / f"{setting.replace('/', '-')}-s{seed}"


def at_least(rows, key, value, metric):
    """The metric in the first training row whose `key` reaches `value` (None if none does)."""
    return next((r.get(metric) for r in rows if r[key] >= value), None)


def plot_found(data, plot_to):
    """Red-teaming: distinct successful attacks found against groups generated and against wall
    time, a line per run, a colour per setting."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    for colour, (setting, runs_) in enumerate(data.items()):
        for i, (train_rows, _) in enumerate(runs_):
            found = [r["redteam/unique_successes"] for r in train_rows]
            for ax, x in zip(axes, ("gen_groups", "time")):
                ax.plot([r[x] for r in train_rows], found, color=f"C{colour}", lw=1,
                        label=setting if i == 0 else None)
    axes[0].set(xlabel="groups of 4 attacks generated", ylabel="distinct successful attacks")
    axes[1].set(xlabel="wall time, s (runs shared cores: compare within a setting)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(plot_to, dpi=120)
    print(f"\nplot: {plot_to}")


def plot_frontier(points, plot_to):
    """Red-teaming: the diversity–success frontier, a dot per run at its (distinct successes,
    diversity of the newest successes) at equal groups generated, a line per method through the
    seeds' means at each β, labelled by β."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for colour, (method, by_beta) in enumerate(sorted(points.items())):
        means = []
        for beta, runs_ in sorted(by_beta.items()):
            if not runs_:                 # no run with two successes: no diversity to draw
                continue
            ax.scatter([f for f, _ in runs_], [d for _, d in runs_], color=f"C{colour}", s=12,
                       alpha=0.5)
            means.append((statistics.mean(f for f, _ in runs_),
                          statistics.mean(d for _, d in runs_), beta))
            ax.annotate(f"β {beta:g}", means[-1][:2], fontsize=7, color=f"C{colour}")
        ax.plot([m[0] for m in means], [m[1] for m in means], "o-", color=f"C{colour}",
                label=method)
    ax.set(xlabel="distinct successful attacks, equal groups generated",
           ylabel="diversity of the successes")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(plot_to, dpi=120)
    print(f"\nfrontier plot: {plot_to}")


def beta_of(flags, task):
    """The β a setting trains at: its --beta, else the task's default."""
    import tasks
    return float(flags[flags.index("--beta") + 1]) if "--beta" in flags \
        else tasks.task_class(task).defaults["beta"]


def report(task, runs, seeds, steps, settings, plot_to=None, frontier_to=None):
    metrics = METRICS[task]
    print(f"\n{task}: final evaluation, {len(seeds)} seeds, mean ± sd [min–max]\n")
    print("| setting | " + " | ".join(metrics) + " | modes 6 (seeds) | samples | wall s |")
    print("|---|" + "---|" * (len(metrics) + 3))
    data = {}
    for setting in settings:
        done = [folder(runs, setting, s) for s in seeds if finished(folder(runs, setting, s), steps)]
        if not done:
            continue
        data[setting] = [read(d) for d in done]
        finals = {m: [next(e[m] for e in reversed(ev) if m in e) if any(m in e for e in ev)
                      else t[-1][m] for t, ev in data[setting]] for m in metrics}
        full = (sum(v == 6 for v in finals["toy/modes"]) if "toy/modes" in finals else "–")
        print(f"| {setting} | " + " | ".join(summary(finals[m]) for m in metrics)
              + f" | {full} | {data[setting][0][0][-1]['samples']} | "
              f"{summary([t[-1]['time'] for t, _ in data[setting]], 0)} |")
    if task == "redteam" and data:
        # Attacks generated: a one-searcher run generates more than it trains on.
        generated = min(t[-1]["gen_groups"] for runs_ in data.values() for t, _ in runs_)
        wall = min(t[-1]["time"] for runs_ in data.values() for t, _ in runs_)
        print(f"\nunique successful attacks at equal groups generated ({generated}) and at "
              f"equal wall time ({wall:.0f} s):\n")
        print("| setting | found, equal generated | found, equal wall time | diversity of the "
              "newest 256 attacks' successes, equal generated |\n|---|---|---|---|")
        points = {}                     # method -> β -> [(found, diversity) per seed]
        for setting, runs_ in data.items():
            gen, clock, diversity = [], [], []
            for t, _ in runs_:
                gen.append(at_least(t, "gen_groups", generated, "redteam/unique_successes") or 0)
                clock.append(at_least(t, "time", wall, "redteam/unique_successes") or 0)
                diversity.append(at_least(t, "gen_groups", generated, "redteam/diversity"))
            print(f"| {setting} | {summary(gen, 1)} | {summary(clock, 1)} | "     # undefined:
                  f"{summary([d for d in diversity if d is not None])} |")     # left out
            method = setting.split("/")[-1]
            points.setdefault(method, {})[beta_of(SETTINGS[task][setting], task)] = \
                [(f, d) for f, d in zip(gen, diversity) if d is not None]
        if plot_to:
            plot_found(data, plot_to)
        if frontier_to:
            plot_frontier(points, frontier_to)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("task", choices=sorted(SETTINGS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--settings", nargs="+", help="default: all of the task's")
    parser.add_argument("--lanes", type=int, default=1, choices=(1, 2))
    parser.add_argument("--runs", type=Path, help="default: runs/bench-explore-TASK")
    parser.add_argument("--steps", type=int, help="default: the task's; longer runs go to "
                        "their own folder and evaluate 5 times")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--plot", type=Path, help="redteam: PNG of distinct successes found "
                        "against groups generated and wall time")
    parser.add_argument("--frontier", type=Path, help="redteam: PNG of diversity against "
                        "distinct successes, a line per method over its β settings")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO))
    import tasks
    steps = args.steps or tasks.task_class(args.task).defaults["steps"]
    longer = ["--steps", str(steps), "--eval-every", str(steps // 5)] if args.steps else []
    runs = args.runs or REPO / "runs" / (f"bench-explore-{args.task}"
                                         + (f"-{steps}" if args.steps else ""))
    chosen = args.settings or list(SETTINGS[args.task])
    todo = [(["--task", args.task, "--seed", str(seed), *SETTINGS[args.task][setting], *longer],
             folder(runs, setting, seed)) for seed in args.seeds for setting in chosen]
    todo = [t for t in todo if not finished(t[1], steps)]
    if not args.report_only:       # a longer run checkpoints every 10 steps, resumed if stopped
        run_all(todo, args.lanes, save_every=10 if args.steps else 0)
    report(args.task, runs, args.seeds, steps, chosen, args.plot, args.frontier)


if __name__ == "__main__":
    main()
