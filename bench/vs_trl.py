"""tba against TRL's GRPOTrainer: same task, model, prompts, reward, budget and evaluation.

    pip install "trl==1.16.0" "torch==2.13.0" "transformers==5.23.0"   # TRL: this bench only
    python bench/vs_trl.py              # arith, 4 systems x seeds 0 1 2: 12 runs of 100 steps,
                                        # ~15 h on 2 cores (at the earlier 25 steps, measured in
                                        # sittings: 1 h 38 min for tba-async and trl-default,
                                        # 2 h 10 min for tba-sync and trl-comparable)
    python bench/vs_trl.py --quick      # seed 0, 4 steps, 32 test problems: 12.5 min measured
    python bench/vs_trl.py -- --beta 0.05 --beta-final 0.05   # tba.py flags after `--` change
                                        # every system's settings, TRL's matched too (README: β 0.05)
    python bench/vs_trl.py --systems trl-default -- --lr 3e-6   # TRL at its own learning rate
                                        # (in runs/bench-vs-trl-lr-3e-6)
    python bench/vs_trl.py --report-only   # no runs: the table of the finished ones (a seed
                                        # not finished is left out of its system's row)
    python bench/vs_trl.py trl trl-comparable --task arith --seed 0 --out DIR   # one TRL run,
                                        # with the settings these tba.py flags would use

A researcher choosing between tba and TRL asks: does it learn as well, and is it faster? Each
system trains SmolLM2-135M-Instruct on the CPU with the task's tba defaults (arith: 100 steps of
B = 4 prompts x K = 8 completions, 32 new tokens, temperature 0.7, β = 0.05, AdamW at lr 1e-5
with warm-up-stable-decay 5/10 steps), each run in a fresh process on all cores:
  tba-sync        python tba.py --searchers 0   on-policy trajectory balance, one process
  tba-async       python tba.py --searchers 1   a searcher process and the trainer, a core each
  trl-default     trl.GRPOTrainer, GRPOConfig defaults except the matched settings below
  trl-comparable  the same, with TRL's compute made tba's: activation_checkpointing (TRL's
                  gradient_checkpointing) and bf16 as tba runs the task (arith: checkpointing
                  off, bf16 where the CPU has native bfloat16; the report prints the exact
                  difference). TRL's defaults turn both on. bf16 makes accelerate wrap the
                  model's forward in bfloat16 autocast, so TRL samples (`generate` too), scores
                  and trains in bfloat16, as tba's --dtype auto does on such a CPU (float32 on
                  others). Checkpointing recomputes each decoder layer in backward; TRL
                  switches it off around `generate`, so it leaves the generation cache on.
Matched (tba setting -> GRPOConfig field or GRPOTrainer argument):
  train prompts, in the order tba-sync draws them -> a Dataset of the formatted texts (str
      prompts: TRL tokenises them as they are; the run checks they give tba's token ids, so no
      second chat template or BOS), shuffle_dataset=False
  reward -> reward_funcs=[task.reward on the same Prompt objects, looked up by index]
  B x K completions per step, each trained on once -> per_device_train_batch_size = K x
      (--micro-groups or B), gradient_accumulation_steps = the rest of B, num_iterations=1
  K, max_new_tokens, temperature -> num_generations, max_completion_length, temperature
      (top_p=1, top_k=0: pure sampling, TRL's defaults too)
  β -> beta (TB's target p_ref·exp(r/β) is the optimum of RL with KL coefficient β)
  AdamW and the WSD schedule -> optimizers=schedules.make_optimizer(...) (weight decay 0),
      learning_rate=lr (recorded only); --max-grad-norm -> max_grad_norm; steps -> max_steps
  seed, CPU threads -> seed, use_cpu=True, torch.set_num_threads as tba-sync (placement.plan_layout)
  no checkpoints mid-run, log every step -> tba --save-every 0; save_strategy="no",
      logging_steps=1, report_to="none"
The algorithm stays TRL's own: GRPO advantages scaled by the group's standard deviation
(scale_rewards="group"), loss_type="dapo", a per-token k3 KL estimate; so β weighs the KL
against a normalised advantage in TRL and against r itself in TB.
Evaluation is the project's: greedy accuracy on the same first --eval-n test problems, at
step 0, every --eval-every steps and at the end, in eval mode: TRL's policy in float32, tba's
at its --dtype (float32, or bfloat16 autocast when it trains in it: then 0.352 at step 0
against float32's 0.367 on arith; a difference between the systems that is not yet removed).
`time` is wall time since training began (after the models are loaded), evaluations included,
as tba's metrics.jsonl counts it; TRL runs write their rows in the same format. s per step
leaves evaluations out; tba-async's first step includes the searcher's start-up. The report
gives each figure as mean ± sd [min–max] over the seeds, then whether the goals are met: tba's
mean end accuracy at least the best TRL row's, with an sd no larger; its accuracy at the first
evaluation (step 10) within 3 points of the best TRL row's there. TRL at its own learning rate
runs in a folder of its own (`-- --lr 3e-6` above); `--trl-runs` puts those rows in the report
of this folder's runs. Runs go seed by seed (a stopped bench has every system for the first
seeds); a finished run in --runs is skipped, an unfinished one is started again. Every run
folder holds a metrics.jsonl in tba's format: `python tba.py plot DIR [DIR ...]` draws them.
"""
import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from compare import REPO             # also puts the repo on sys.path
from lag import summary as spread   # mean ± sd [min–max] (n=...)
import config
from plumbing import bookkeeping, plot
from devices import placement
import tasks
from plumbing import schedules
from plumbing.run import MetricsLog

SYSTEMS = {"tba-sync": ["--searchers", "0"], "tba-async": ["--searchers", "1"],
           "trl-default": None, "trl-comparable": None}
QUICK = dict(seeds=[0], steps=4, eval_n=32)


def run_trl(system, tba_argv):
    """One TRL run in this process with the settings `python tba.py *tba_argv` would use."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.models.utils import disable_gradient_checkpointing

    cfg = config.resolve(config.parse_args([*tba_argv, *SYSTEMS["tba-sync"]])[0])
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(placement.plan_layout(cfg).threads)
    torch.manual_seed(cfg.seed)
    task = tasks.make_task(cfg)
    policy, tokenizer = task.load_model(torch.device("cpu"))
    train = {p.index: p for p in task.prompts("train", tokenizer)}
    batches = tasks.prompt_batches(list(train.values()), cfg.prompts_per_step, cfg.seed)
    order = [p for _ in range(cfg.steps) for p in next(batches)]
    scored = 0

    def reward(prompts, completions, index, **_):
        nonlocal scored
        chosen = [train[i] for i in index]
        assert [p.text for p in chosen] == prompts, "TRL paired prompts and rows wrongly"
        scored += len(completions)
        return task.reward(chosen, completions)

    micro = cfg.micro_groups or cfg.prompts_per_step
    if cfg.prompts_per_step % micro:
        raise SystemExit(f"error: TRL needs --micro-groups to divide B = {cfg.prompts_per_step}")
    compute = ({} if system == "trl-default" else
               dict(activation_checkpointing=cfg.activation_checkpointing,
                    bf16=cfg.dtype == "bfloat16"))
    args = GRPOConfig(
        output_dir=str(out), use_cpu=True, seed=cfg.seed, max_steps=cfg.steps,
        per_device_train_batch_size=micro * cfg.group_size,
        gradient_accumulation_steps=cfg.prompts_per_step // micro, num_iterations=1,
        num_generations=cfg.group_size, max_completion_length=cfg.max_new_tokens,
        temperature=cfg.temperature, top_p=1.0, top_k=0, beta=cfg.beta, learning_rate=cfg.lr,
        max_grad_norm=cfg.max_grad_norm, shuffle_dataset=False, logging_steps=1,
        save_strategy="no", report_to="none", disable_tqdm=True, **compute)
    optimizers = schedules.make_optimizer(policy, cfg.lr, cfg.steps, cfg.warmup_steps,
                                          cfg.decay_steps)
    grpo = GRPOTrainer(model=policy, reward_funcs=[reward], args=args, processing_class=tokenizer,
                       optimizers=optimizers, train_dataset=Dataset.from_list(
                           [{"prompt": p.text, "index": p.index} for p in order]))
    fed = grpo._tokenize_prompts([order[0].text])[0][0]
    if list(fed) != order[0].ids:
        raise SystemExit(f"error: TRL tokenises the prompt as {tokenizer.decode(fed)!r}, "
                         f"not as tba does ({order[0].text!r})")
    (out / "trl_args.json").write_text(args.to_json_string())
    log = MetricsLog(out / "metrics.jsonl")

    @contextlib.contextmanager
    def as_tba_evaluates(model):
        """The policy as tba evaluates it: eval mode, at tba's precision (`Task.policy_precision`,
        without the bfloat16 autocast that accelerate wraps around `forward` under bf16=True), no
        activation checkpointing."""
        wrapped, training = model.forward, model.training
        model.forward = getattr(model, "_original_forward", wrapped)
        model.eval()
        try:
            with disable_gradient_checkpointing(model, args.activation_checkpointing_kwargs):
                yield
        finally:
            model.forward = wrapped
            model.train(training)

    class Evaluate(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.start = time.time()
            self.evaluate(model, 0)

        def on_log(self, args, state, control, logs=None, model=None, **kwargs):
            if "loss" not in logs:           # the summary logged after the last step
                return
            step = state.global_step
            log.write({"step": step, "time": round(time.time() - self.start, 3),
                       "samples": scored, "loss": logs["loss"], "reward_mean": logs["reward"],
                       "kl": logs.get("kl"), "lr": logs["learning_rate"]})
            if (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.steps:
                self.evaluate(model, step)

        def evaluate(self, model, step):
            with as_tba_evaluates(model):
                bookkeeping.evaluate(task, model, tokenizer, grpo.ref_model, step=step,
                                     start=self.start, log=log)

    grpo.remove_callback(PrinterCallback)
    grpo.add_callback(Evaluate())
    grpo.train()
    print(f"{system}: {cfg.steps} steps, {scored} completions scored")


def finished(out, steps):
    """A run folder whose final evaluation is logged."""
    return (out / "metrics.jsonl").is_file() and any(
        r["step"] == steps for r in plot.read_metrics(out)[1])


def run(system, seed, out, flags, steps):
    if finished(out, steps):
        return
    if out.exists():
        print(f"{out} is unfinished: starting it again")
        shutil.rmtree(out)
    command = ([sys.executable, "tba.py", *SYSTEMS[system]] if SYSTEMS[system] is not None
               else [sys.executable, str(Path(__file__).resolve()), "trl", system])
    print(f"== {system}, seed {seed}", flush=True)
    done = subprocess.run([*command, *flags, "--seed", str(seed), "--quiet", "--out", str(out)],
                          cwd=REPO)
    if done.returncode:
        sys.exit(f"error: the {system} run with seed {seed} failed (exit {done.returncode})")


def stats(out, metric, seconds):
    """One run -> its evaluations [(time, value)] and its mean seconds per step: the time
    between a step's row and the row before it (evaluations left out)."""
    train_rows, eval_rows = plot.read_metrics(out)
    rows = sorted(train_rows + eval_rows, key=lambda r: r["time"])
    step_s = statistics.mean(r["time"] - before["time"] for before, r in zip(rows, rows[1:])
                             if "loss" in r)
    by_then = [r for r in eval_rows if r["time"] <= seconds] or eval_rows[:1]   # still step 0
    return dict(curve=[(r["time"], r[metric]) for r in eval_rows], step_s=step_s,
                by_step={r["step"]: (r["time"], r[metric]) for r in eval_rows},
                start=eval_rows[0][metric], end=eval_rows[-1][metric],
                at_equal=by_then[-1][metric], wall=eval_rows[-1]["time"])


def time_to(curve, target):
    return next((t for t, value in curve if value >= target), math.inf)


def machine():
    cpuinfo = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
             if line.startswith("model name")] if cpuinfo.is_file() else []
    return f"{names[0] if names else platform.processor()}, {os.cpu_count()} cores"


def versions():
    def version(package):
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=REPO).stdout.strip()
    packages = ", ".join(f"{p} {version(p)}" for p in ("torch", "transformers", "trl"))
    return f"{packages}, tba {commit}"


def draw(results, metric, target, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for i, (system, runs) in enumerate(results.items()):
        for j, r in enumerate(runs):
            ax.plot(*zip(*r["curve"]), color=f"C{i}", marker="o", markersize=3, linewidth=1.2,
                    label=system if j == 0 else None)
    ax.axhline(target, color="grey", linestyle=":", linewidth=1, label=f"target {target:.3f}")
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel(f"greedy {metric}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def trl_differences(outs):
    """-> "field default -> comparable, ..." from the GRPOConfigs the two TRL runs recorded."""
    default, comparable = (json.loads((outs[s][0] / "trl_args.json").read_text())
                           for s in ("trl-default", "trl-comparable"))
    return ", ".join(f"{k} {v} -> {comparable[k]}" for k, v in default.items()
                     if k != "output_dir" and comparable[k] != v)


def report(results, outs, metric, target, seconds, steps, args):
    sizes = {len(runs) for runs in outs.values()}   # --report-only: rows may have fewer seeds
    n = f"{sizes.pop()} seeds" if len(sizes) == 1 else "seeds: n= in each cell"
    how = "" if args.target is not None else " (midway between step 0 and the best end)"
    print(f"\n{args.task}: {steps} steps, the same completions trained on by every run; "
          f"'at {seconds:.0f} s' = the last evaluation by the time the first run finished; "
          f"target {target:.3f}{how}\n")
    print(f"| system ({n}) | {metric} step 0 | {metric} end | {metric} at "
          f"{seconds:.0f} s | s per step | s to reach {target:.3f} | wall (s) |\n|" + " --- |" * 7)
    for system, runs in results.items():
        reach = [time_to(r["curve"], target) for r in runs]
        missed = sum(t == math.inf for t in reach)
        reach_text = spread(reach, 0) if not missed else f"not reached in {missed} of {len(runs)}"
        print(f"| {system} | " + " | ".join(
            [spread([r[k] for r in runs], 3) for k in ("start", "end", "at_equal")]
            + [spread([r["step_s"] for r in runs], 1), reach_text,
               spread([r["wall"] for r in runs], 0)]) + " |")
    print(f"\n{metric} at each evaluation (a peak then a fall shows the end is fragile)\n\n"
          "| system | step | " + metric + " | time (s) |\n| --- | --- | --- | --- |")
    for system, runs in results.items():
        for step in sorted(set.intersection(*(set(r["by_step"]) for r in runs))):
            times, values = zip(*(r["by_step"][step] for r in runs))
            print(f"| {system} | {step} | {spread(values, 3)} | {spread(times, 0)} |")
    print(f"\nmachine: {machine()}; {versions()}\ncommand: python {' '.join(sys.argv)}")
    if "trl-default" in results and "trl-comparable" in results:
        print(f"trl-comparable's GRPOConfig differs from trl-default's in: {trl_differences(outs)}")
    for line in goals(results):
        print(line)


def goals(results):
    """The comparison's goals, one line per tba system: its mean end accuracy at least the best
    TRL row's, with an sd no larger than that row's; and its accuracy at the first evaluation
    after step 0 (step 10 on arith) within 3 points of the TRL row that is best there."""
    def end(runs):
        return [r["end"] for r in runs]

    def early(runs):
        step = min(set.intersection(*(set(r["by_step"]) for r in runs)) - {0})
        return step, [r["by_step"][step][1] for r in runs]

    def sd(values):
        return statistics.stdev(values) if len(values) > 1 else 0.0
    trl = [s for s in results if s.startswith("trl")]
    if not trl:
        return []
    met = {True: "met", False: "not met"}
    best = max(trl, key=lambda s: statistics.mean(end(results[s])))
    fastest = max(trl, key=lambda s: statistics.mean(early(results[s])[1]))
    lines = []
    for system in (s for s in results if s.startswith("tba")):
        mine, theirs = end(results[system]), end(results[best])
        step, at_step = early(results[system])
        their_step, theirs_early = early(results[fastest])
        lines.append(
            f"goal, {system}: end {statistics.mean(mine):.3f} ± {sd(mine):.3f} vs {best}'s "
            f"{statistics.mean(theirs):.3f} ± {sd(theirs):.3f}: mean at least theirs "
            f"{met[statistics.mean(mine) >= statistics.mean(theirs)]}, sd at most theirs "
            f"{met[sd(mine) <= sd(theirs)]}; step {step} {statistics.mean(at_step):.3f} vs "
            f"{fastest}'s {statistics.mean(theirs_early):.3f} (step {their_step}), within 0.03 "
            f"{met[statistics.mean(at_step) >= statistics.mean(theirs_early) - 0.03]}")
    return lines


def main(argv):
    if argv[:1] == ["trl"]:
        return run_trl(argv[1], argv[2:])
    argv, tba_flags = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv \
        else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", default="arith", help="any task with a reward (default arith)")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS),
                        help="which systems to run and report (default: all four)")
    parser.add_argument("--seeds", type=int, nargs="+", help="default 0 1 2 (--quick: 0)")
    parser.add_argument("--steps", type=int, help="trainer steps of every run (default: the "
                                                  "task's, --quick: 4)")
    parser.add_argument("--eval-n", type=int, help="test problems per evaluation (default: the "
                                                   "task's, --quick: 32)")
    parser.add_argument("--quick", action="store_true", help="one seed, 4 steps, 32 test problems")
    parser.add_argument("--runs", default="", help="folder of the runs (default runs/bench-vs-trl"
                        ", -quick and the tba.py flags appended: runs/bench-vs-trl-beta-0.05-...)")
    parser.add_argument("--metric", default="eval/accuracy", help="evaluation metric compared "
                        "(default eval/accuracy; e.g. eval/win_rate for summarize)")
    parser.add_argument("--target", type=float, help="the metric value whose time to reach is "
                        "reported (default: midway between step 0 and the best system's end)")
    parser.add_argument("--plot", default="", help="write the metric against wall time here (.png)")
    parser.add_argument("--report-only", action="store_true", help="no runs: the table (and "
                        "plot) of the finished ones; a seed not finished is left out of its row")
    parser.add_argument("--trl-runs", nargs="+", default=[], help="more folders of this bench "
                        "whose finished TRL runs join the report, named by the folder's flags, "
                        "e.g. runs/bench-vs-trl-lr-3e-6 (TRL at its own learning rate)")
    parser.epilog = ("tba.py flags after `--` apply to every run, e.g. `-- --beta 0.05 "
                     "--beta-final 0.05` (the TRL runs get the matching settings)")
    args = parser.parse_args(argv)
    for key, value in QUICK.items():
        if args.quick and getattr(args, key) is None:
            setattr(args, key, value)
    args.seeds = args.seeds or [0, 1, 2]
    if (not args.report_only and any(s.startswith("trl") for s in args.systems)
            and not importlib.util.find_spec("trl")):
        sys.exit('error: TRL is not installed: pip install "trl==1.16.0" "torch==2.13.0" '
                 '"transformers==5.23.0"')
    folder = (Path(args.runs).resolve() if args.runs
              else REPO / "runs" / "-".join(["bench-vs-trl", *["quick"] * args.quick,
                                             *(f.lstrip("-") for f in tba_flags)]))
    flags = ["--task", args.task, "--device", "cpu", "--save-every", "0"]
    flags += ["--steps", str(args.steps)] * (args.steps is not None)
    flags += ["--eval-n", str(args.eval_n)] * (args.eval_n is not None)
    flags += tba_flags
    try:  # bad tba.py flags stop the bench here, before any run starts
        config.resolve(config.parse_args([*flags, *SYSTEMS["tba-sync"]])[0])
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    extra = [Path(d).resolve() for d in args.trl_runs]
    for d in extra:
        if not d.is_dir():
            print(f"error: --trl-runs {d} is not a folder: give one this bench wrote, e.g. "
                  "runs/bench-vs-trl-lr-3e-6", file=sys.stderr)
            sys.exit(2)
    steps = args.steps or tasks.task_class(args.task).defaults["steps"]
    outs = {s: [folder / f"{s}-s{seed}" for seed in args.seeds] for s in args.systems}
    for i, seed in enumerate(args.seeds):
        for system in args.systems:
            if not args.report_only:
                run(system, seed, outs[system][i], flags, steps)
    outs = {s: [o for o in runs if finished(o, steps)] for s, runs in outs.items()}
    outs = {s: runs for s, runs in outs.items() if runs}   # --report-only: what has finished
    if not outs:
        print(f"error: no finished run of {', '.join(args.systems)} in {folder}: run the bench "
              "without --report-only first (or give --runs the folder it wrote)", file=sys.stderr)
        sys.exit(2)
    for d in extra:   # reported only: their runs are started by this bench with their own flags
        for system in (s for s in SYSTEMS if s.startswith("trl")):
            runs = [d / f"{system}-s{seed}" for seed in args.seeds]
            if all(finished(r, steps) for r in runs):
                outs[f"{system} {d.name.removeprefix('bench-vs-trl-')}"] = runs
    seconds = min(plot.read_metrics(o)[1][-1]["time"] for runs in outs.values() for o in runs)
    results = {s: [stats(o, args.metric, seconds) for o in runs] for s, runs in outs.items()}
    target = args.target
    if target is None:
        start = statistics.mean(r["start"] for runs in results.values() for r in runs)
        target = (start + max(statistics.mean(r["end"] for r in runs)
                              for runs in results.values())) / 2
    report(results, outs, args.metric, target, seconds, steps, args)
    if args.plot:
        draw(results, args.metric, target, args.plot)
        print(args.plot)


if __name__ == "__main__":
    main(sys.argv[1:])
