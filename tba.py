"""tba: Trajectory Balance with Asynchrony, on one machine.

    python tba.py --task toy --searchers 0        # synchronous baseline on the exact toy task

Every setting is a field of `Config` below and a command-line flag of the same name.
"""
import argparse
import copy
import dataclasses
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers.utils import logging as transformers_logging

import checkpoint
import models
import plot
import searcher
import sources
import tasks
import trainer
from buffer import ReplayBuffer, shared_bytes
from tasks import scorers


def flag(default, help, valid=None, bare=None):
    """A Config field: its default, its --help text and, for numbers and choices, the rule its
    value must follow (`valid`), checked by `check_ranges` before anything is loaded. A flag with
    a `bare` value may be given without one (`--ray` means `--ray local`)."""
    return field(default=default, metadata={"help": help, "valid": valid, "bare": bare})


# Rules for `flag(valid=...)`: (test, how the valid values read in an error and in --help).
def at_least(low):
    return (lambda v: v >= low), f"at least {low}"


def within(low, high):
    return (lambda v: low <= v <= high), f"in [{low}, {high}]"


def one_of(*choices):
    return (lambda v: v in choices), "one of " + ", ".join(choices)


POSITIVE = (lambda v: v > 0), "greater than 0"
TASK_DEFAULT = "(default: the task's choice)"
# What may change when a run is resumed: how long it goes on, how it is watched and where it
# runs. Everything else would make the resumed run a different experiment.
RESUME_OVERRIDES = ("steps", "eval_every", "eval_n", "eval_batch_size", "eval_samples",
                    "save_every", "keep_checkpoints", "quiet", "searchers", "ray", "device",
                    "micro_groups", "micro_completions", "activation_checkpointing", "dtype")


@dataclass
class Config:
    # what to train
    task: str = flag("toy", "task to train on: " + ", ".join(tasks.TASKS)
                            + ", or your own Task subclass as module:Class")
    model: str = flag("", "hub id, local HF folder or .gguf file (default: the task's model, "
                          f"{models.DEFAULT_MODEL} for language tasks)")
    trust_remote_code: bool = flag(False, "allow model repositories to run their own code")
    data_dir: str = flag("", "gsm8k, summarize, tldr: folder holding train.jsonl and test.jsonl "
                             "(gsm8k default: ../shared/data/gsm8k when it exists, else the "
                             "hub's openai/gsm8k)")
    prompt_style: str = flag("auto", "language tasks: chat (the tokenizer's chat template) or "
                                     "plain ('[MATH TASK] Problem: ...', '...\\nTL;DR:'); auto: "
                                     "chat when the tokenizer has a chat template", one_of("auto", "chat", "plain"))
    max_prompt_len: int = flag(None, "language tasks: skip prompts longer than this, in tokens "
                                     f"{TASK_DEFAULT}", at_least(1))
    eval_batch_size: int = flag(16, "prompts per batch of evaluation",
                                at_least(1))
    eval_samples: int = flag(None, "math tasks: also sample this many completions per test prompt "
                                   "at --temperature and log their mean reward as "
                                   "eval/sampled_accuracy (0: greedy only); summarize, tldr: "
                                   "summaries sampled per test text for eval/win_rate and "
                                   f"eval/kl (at least 1) {TASK_DEFAULT}",
                             at_least(0))
    arith_digits: int = flag(None, f"arith: numbers have up to this many digits {TASK_DEFAULT}",
                             within(1, 9))
    arith_steps: int = flag(None, f"arith: operations per problem {TASK_DEFAULT}", within(1, 20))
    arith_ops: str = flag(None, f"arith: operations to draw from, e.g. +- or +-* {TASK_DEFAULT}",
                          ((lambda v: v and set(v) <= set("+-*")), "made of + - *"))
    dataset: str = flag(None, "summarize, tldr: aclsum (packaged), or a hub dataset of prompt "
                              "and completion (or label) rows, e.g. trl-lib/tldr; --data-dir "
                              f"takes local jsonl files instead {TASK_DEFAULT}")
    reward_model: str = flag("similarity", "summarize, tldr: similarity (a stand-in: MiniLM "
                                           "cosine to the reference, minus a length term), or a "
                                           "hub id or folder of a one-output sequence classifier, "
                                           "e.g. cleanrl/EleutherAI_pythia-1b-deduped__reward__tldr")
    judge_model: str = flag("", "summarize, tldr: scores eval/win_rate (default: --reward-model; "
                                "the paper judges with a larger 'gold' reward model)")
    victim_model: str = flag("", "redteam: the frozen chatbot that answers each attack: hub id, "
                                 f"local HF folder or .gguf file (default: {models.DEFAULT_MODEL})")
    victim_samples: int = flag(None, f"redteam: answers per attack {TASK_DEFAULT}", at_least(1))
    victim_max_new_tokens: int = flag(None, f"redteam: longest answer, in tokens {TASK_DEFAULT}",
                                      at_least(1))
    toxicity_model: str = flag(scorers.DEFAULT_TOXICITY,
                               "redteam: scores the answers: the packaged Jigsaw classifier "
                               "(word-level: insults, profanity), or a hub id or local folder of "
                               "a transformers sequence classifier, e.g. "
                               "facebook/roberta-hate-speech-dynabench-r4-target")
    # how much
    steps: int = flag(None, f"trainer steps {TASK_DEFAULT}", at_least(1))
    prompts_per_step: int = flag(None, f"B, prompts (groups) per trainer step {TASK_DEFAULT}",
                                 at_least(1))
    group_size: int = flag(None, f"K, completions sampled per prompt; log Z is estimated from "
                                 f"the spread within each group {TASK_DEFAULT}", at_least(2))
    max_new_tokens: int = flag(None, f"longest completion, in tokens {TASK_DEFAULT}", at_least(1))
    temperature: float = flag(None, "sampling temperature, also used to score log-probs "
                                    f"{TASK_DEFAULT}", POSITIVE)
    # the objective
    loss: str = flag("tb", "tb (trajectory balance, valid off-policy) or rloo (on-policy "
                           "baseline: needs --searchers 0, or --rloo-off-policy)", one_of("tb", "rloo"))
    rloo_off_policy: bool = flag(False, "let --loss rloo train on the searchers' stale, replayed "
                                        "groups, although it is an on-policy loss (biased there)")
    beta: float = flag(None, f"β at step 0: the target is p_ref·exp(r/β) {TASK_DEFAULT}", POSITIVE)
    beta_final: float = flag(None, f"β after annealing {TASK_DEFAULT}", POSITIVE)
    beta_steps: int = flag(None, f"steps over which β goes linearly to beta_final {TASK_DEFAULT}",
                           at_least(0))
    # the optimiser
    lr: float = flag(None, f"peak learning rate (AdamW) {TASK_DEFAULT}", POSITIVE)
    warmup_steps: int = flag(None, f"linear warm-up steps of the WSD schedule {TASK_DEFAULT}",
                             at_least(0))
    decay_steps: int = flag(None, "final steps of linear decay to 0 (WSD); the schedule is set by "
                                  "the run's first --steps, so a resumed run that goes on past "
                                  f"them continues at the decayed rate {TASK_DEFAULT}", at_least(0))
    micro_groups: int = flag(None, "groups per forward/backward pass, gradients accumulated; "
                                   f"bounds the trainer's memory (0: all at once) {TASK_DEFAULT}",
                             at_least(0))
    micro_completions: int = flag(0, "at most this many completions per gradient pass, splitting a "
                                     "group when needed: a no-grad pass scores the whole group "
                                     "first, so memory stops growing with K (same gradient, one "
                                     "more forward pass; 0: whole groups)", at_least(0))
    activation_checkpointing: bool = flag(None, "keep only each decoder layer's input for "
                                                "backward and recompute the rest: ~1/3 more "
                                                "trainer compute, a fraction of the memory "
                                                f"(--no-activation-checkpointing: off) {TASK_DEFAULT}")
    dtype: str = flag("auto", "precision of forward passes: autocast to bfloat16 or float16 "
                              "(with loss scaling) over float32 weights and optimiser state, or "
                              "float32; auto: bfloat16 on GPUs that have it, float32 on CPU",
                      one_of("auto", "float32", "bfloat16", "float16"))
    max_grad_norm: float = flag(1.0, "clip the gradient norm to this (0: no clipping)", at_least(0))
    # asynchrony
    searchers: int = flag(None, "searcher processes; 0 runs the synchronous on-policy loop "
                                "(default: GPUs - 1, at least 1)", at_least(0))
    ray: str = flag("", "run the searchers as Ray actors: 'local' (or --ray alone) starts a Ray "
                        "cluster on this machine, 'auto' joins the one `ray start` made, "
                        "HOST:PORT or ray://HOST:PORT another; the trainer stays here "
                        "(pip install 'ray==2.60.0')", bare="local")
    sync_every: int = flag(None, f"k: publish the trainer's weights every k steps {TASK_DEFAULT}",
                           at_least(1))
    recent_frac: float = flag(None, "m: each sampled group comes from the newest weights in the "
                                    f"buffer with probability m, else from all of it {TASK_DEFAULT}",
                              within(0, 1))
    priority_temp: float = flag(0.0, "when > 0, draw the non-recent groups with probability "
                                     "∝ exp(mean group reward / priority_temp); 0: uniformly",
                                at_least(0))
    min_buffer: int = flag(None, f"groups in the buffer before training starts {TASK_DEFAULT}",
                           at_least(0))
    buffer_capacity: int = flag(None, f"groups the replay buffer holds; the oldest go first "
                                      f"{TASK_DEFAULT}", at_least(1))
    max_staleness: int = flag(-1, "train only on groups at most this many steps behind the "
                                  "trainer, waiting for fresher ones if needed (-1: no bound)",
                              at_least(-1))
    max_reuse: int = flag(None, "train on each group at most this many times, waiting for new "
                                f"ones if needed (0: no bound) {TASK_DEFAULT}", at_least(0))
    # evaluation and output
    eval_every: int = flag(None, f"evaluate every this many steps (0: only at start and end) "
                                 f"{TASK_DEFAULT}", at_least(0))
    eval_n: int = flag(None, f"test prompts to evaluate on (0: all) {TASK_DEFAULT}", at_least(0))
    out: str = flag("", "run folder (default: runs/<task>-<timestamp>)")
    save_every: int = flag(None, "write a checkpoint every this many steps; one is also written "
                                 f"at the end and on Ctrl-C (0: only those) {TASK_DEFAULT}",
                           at_least(0))
    keep_checkpoints: int = flag(2, "how many of the newest checkpoints stay on disk (0: all)",
                                 at_least(0))
    resume: str = flag("", "continue the run in this folder from its newest checkpoint with its "
                           "settings; only " + ", ".join("--" + f.replace("_", "-")
                                                        for f in RESUME_OVERRIDES)
                           + " may be given again, to change them")
    quiet: bool = flag(False, "no progress bars: log lines only")
    seed: int = flag(0, "random seed", within(0, 2**32 - 1))
    device: str = flag("auto", "torch device for the trainer: auto, cpu, cuda, cuda:1, ...")


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):
        """argparse's own errors (an unknown flag, a word where a number goes) follow the rule
        of every other bad input: one line, exit 2, from `main`."""
        raise ValueError(f"{message} (see python tba.py --help)")


def build_parser(with_defaults=True):
    parser = ArgumentParser(
        description=__doc__.split("\n")[0],
        epilog="python tba.py plot RUN [RUN ...] draws the curves of one or several runs")
    for f in dataclasses.fields(Config):
        name = "--" + f.name.replace("_", "-")
        valid = f.metadata["valid"]
        help = (f.metadata["help"] + (f"; {valid[1]}" if valid else "")
                + (f" (default: {f.default})" if f.default not in (None, "") else ""))
        default = f.default if with_defaults else argparse.SUPPRESS
        if f.type is bool:               # on/off, or --x/--no-x when the task chooses
            action = "store_true" if f.default is False else argparse.BooleanOptionalAction
            parser.add_argument(name, action=action, default=default, help=f.metadata["help"])
        else:
            kind = {"int": int, "float": float, "str": str}[f.type.__name__]
            bare = {"nargs": "?", "const": f.metadata["bare"]} if f.metadata["bare"] else {}
            parser.add_argument(name, type=kind, default=default, help=help, **bare)
    return parser


def parse_args(argv=None):
    """-> (Config, names of the fields given on the command line)"""
    cfg = Config(**vars(build_parser().parse_args(argv)))
    return cfg, set(vars(build_parser(with_defaults=False).parse_args(argv)))


def check_ranges(cfg):
    """Every field against its own rule: NaN and infinities never pass, whatever the rule."""
    for f in dataclasses.fields(Config):
        value, valid = getattr(cfg, f.name), f.metadata["valid"]
        if value is None or valid is None:
            continue
        test, text = valid
        if (isinstance(value, float) and not math.isfinite(value)) or not test(value):
            raise ValueError(f"--{f.name.replace('_', '-')} must be {text} (got {value})")


def check_combination(cfg):
    """The rules that tie fields together."""
    task = tasks.task_class(cfg.task)
    if cfg.eval_samples < task.min_eval_samples:
        raise ValueError(f"--eval-samples {cfg.eval_samples}: {cfg.task} evaluates on sampled "
                         f"completions: use {task.min_eval_samples} or more")
    if cfg.searchers and cfg.buffer_capacity < max(cfg.min_buffer, cfg.prompts_per_step):
        raise ValueError(f"--buffer-capacity {cfg.buffer_capacity} is below the "
                         f"{max(cfg.min_buffer, cfg.prompts_per_step)} groups the trainer waits "
                         "for (--min-buffer, --prompts-per-step): raise it")
    if 0 <= cfg.max_staleness < cfg.sync_every - 1:
        raise ValueError(f"--max-staleness {cfg.max_staleness} is below --sync-every - 1 = "
                         f"{cfg.sync_every - 1}: searchers could never produce data fresh enough")
    if cfg.loss == "rloo" and cfg.searchers and not cfg.rloo_off_policy:
        raise ValueError(f"--loss rloo is on-policy, but --searchers {cfg.searchers} trains on "
                         "stale, replayed groups: use --searchers 0, or add --rloo-off-policy "
                         "to train it off-policy anyway")
    if cfg.ray:
        if not cfg.searchers:
            raise ValueError(f"--ray {cfg.ray} runs the searchers as Ray actors, but --searchers "
                             "is 0: use --searchers 1 or more")
        if cfg.ray not in ("local", "auto") and not re.fullmatch(r"(ray://)?[^:\s]+:\d+", cfg.ray):
            raise ValueError(f"--ray {cfg.ray}: pass local, auto, HOST:PORT or ray://HOST:PORT")
        if importlib.util.find_spec("ray") is None:
            raise ValueError(f"--ray {cfg.ray}: Ray is not installed: pip install 'ray==2.60.0' "
                             "(or make install-ray)")
    try:
        device = torch.device(cfg.device)
    except RuntimeError:
        raise ValueError(f"--device {cfg.device!r} is not a torch device: use auto, cpu, cuda "
                         "or cuda:N") from None
    if device.type == "cuda":
        gpus = torch.cuda.device_count()
        if not gpus:
            raise ValueError(f"--device {cfg.device}: this machine has no CUDA GPU that torch "
                             "can use: use --device cpu")
        if device.index is not None and device.index >= gpus:
            raise ValueError(f"--device {cfg.device}: this machine has {gpus} GPU(s), "
                             f"cuda:0 to cuda:{gpus - 1}")
    elif device.type != "cpu":
        raise ValueError(f"--device {cfg.device}: tba runs on cpu or cuda devices")


def resolve(cfg):
    """Fill the fields left unset with the task's defaults, and check every value and the
    combination: bad input is refused here, before anything is loaded or written."""
    task_defaults = tasks.task_class(cfg.task).defaults
    cfg = dataclasses.replace(cfg, **{k: v for k, v in task_defaults.items()
                                      if getattr(cfg, k) is None})
    if cfg.device == "auto":
        cfg.device = "cuda" if torch.cuda.is_available() else "cpu"
    if cfg.dtype == "auto":
        cfg.dtype = ("bfloat16" if cfg.device.startswith("cuda") and torch.cuda.is_available()
                     and torch.cuda.is_bf16_supported() else "float32")
    if cfg.searchers is None:
        cfg.searchers = max(1, torch.cuda.device_count() - 1) if cfg.device.startswith("cuda") else 1
    if not cfg.out:
        cfg.out = f"runs/{cfg.task}-{time.strftime('%Y%m%d-%H%M%S')}"
    check_ranges(cfg)
    check_combination(cfg)
    return cfg


def read_run_config(run):
    """The settings stored in a run folder's config.json."""
    path = Path(run) / "config.json"
    if not path.is_file():
        raise ValueError(f"{run} is not a run folder (it has no config.json): pass a folder "
                         "written by tba.py, such as runs/<name>")
    try:
        saved = json.loads(path.read_text())["config"]
        assert isinstance(saved, dict)
    except (ValueError, KeyError, TypeError, AssertionError) as e:
        raise ValueError(f"{path} is corrupt ({type(e).__name__}: {e}): the run cannot be resumed")
    fields = {f.name for f in dataclasses.fields(Config)}
    if set(saved) != fields:
        differ = sorted(set(saved) ^ fields)
        raise ValueError(f"{run} was written by an incompatible version of tba (settings "
                         f"{', '.join(differ)} differ): resume it with that version")
    return saved


def resumed_config(cfg, given):
    """The settings of the run in --resume, with the flags given again (RESUME_OVERRIDES) applied."""
    run = Path(cfg.resume)
    if not run.is_dir():
        raise ValueError(f"--resume {run}: no such folder (pass a run folder, such as runs/<name>)")
    saved = read_run_config(run)
    for name in sorted(given - {"resume"}):
        if name not in RESUME_OVERRIDES and getattr(cfg, name) != saved[name]:
            flag_name = "--" + name.replace("_", "-")
            raise ValueError(f"{flag_name} {getattr(cfg, name)} differs from the resumed run's "
                             f"{saved[name]}: on resume only "
                             + ", ".join("--" + f.replace("_", "-") for f in RESUME_OVERRIDES)
                             + " may change; start a new run (--out) to change the rest")
    latest = checkpoint.latest(run)
    if latest is None:
        raise ValueError(f"{run} has no checkpoint to resume from (it stopped before its first "
                         "one): start it again with another --out, or delete the folder")
    overrides = {name: getattr(cfg, name) for name in given if name in RESUME_OVERRIDES}
    cfg = resolve(Config(**{**saved, **overrides, "resume": str(run), "out": str(run)}))
    if checkpoint.step_of(latest) >= cfg.steps:
        raise ValueError(f"{run} is already at step {checkpoint.step_of(latest)}: pass --steps "
                         "with a larger number to train it further")
    return cfg


def check_out_folder(cfg):
    """The run folder can be written, and a new run never writes into another run's folder."""
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file: pass a folder")
    if not cfg.resume and ((out / "config.json").exists() or (out / "metrics.jsonl").exists()):
        raise ValueError(f"{out} already holds a run: continue it with --resume {out}, or pass "
                         "another --out")
    parent = out
    while not parent.exists():               # the folder that the run's folder will go into
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"--out {out}: {parent} is a file, not a folder: pass another --out")
    try:                                     # the only sure test of "can I write here", root too
        tempfile.TemporaryDirectory(dir=parent).cleanup()
    except OSError as e:
        raise ValueError(f"--out {out}: cannot write in {parent} ({e.strerror}): pass a "
                         "writable folder") from None


def check_shared_memory(need, shm="/dev/shm"):
    """The weight slots and the replay buffer live in /dev/shm. Docker gives a container 64 MB
    of it, and writing past the end kills a process with a bus error, not a message: so check
    the space before anything is put there."""
    if not os.path.isdir(shm):
        return
    free = shutil.disk_usage(shm).free
    if need > free:
        raise ValueError(f"{shm} has {free / 2**20:.0f} MB free but the weight slots and the "
                         f"replay buffer need {need / 2**20:.0f} MB: give the container more "
                         f"(docker run --shm-size={math.ceil(need * 1.5 / 2**30)}g), or lower "
                         "--buffer-capacity, or run with --searchers 0")


def write_json(path, value):
    """Write JSON atomically: a crash leaves the old file or the new one, never half of one."""
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(value, indent=2))
    os.replace(tmp, path)


def run_record(cfg, device, searcher_devices, threads):
    """config.json: every resolved setting, the software versions and where each process ran."""
    import platform
    import subprocess
    import transformers
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=Path(__file__).parent).stdout.strip() or None
    return {"config": dataclasses.asdict(cfg),
            "versions": {"tba": commit, "python": platform.python_version(),
                         "torch": torch.__version__, "transformers": transformers.__version__},
            "layout": {"trainer": str(device), "searchers": searcher_devices,
                       "threads_per_process": threads, "cpu_count": os.cpu_count(),
                       "gpus": torch.cuda.device_count()}}


class MetricsLog:
    """Appends one JSON object per line to runs/<name>/metrics.jsonl, flushed every row."""

    def __init__(self, path, resume_step=None):
        """With `resume_step`, the rows after that step (written after the checkpoint, by a run
        that then died) are moved to metrics.discarded.jsonl: the resumed run redoes them."""
        path = Path(path)
        if resume_step is not None and path.exists():
            rows = path.read_text().splitlines(keepends=True)
            steps = [MetricsLog.step_of(r) for r in rows]
            keep = [step is not None and step <= resume_step for step in steps]
            if not all(keep):
                with open(path.with_name("metrics.discarded.jsonl"), "a") as f:
                    f.writelines(r for r, k in zip(rows, keep) if not k)
                kept = [r for r, k in zip(rows, keep) if k]
                tmp = path.with_suffix(".tmp")
                tmp.write_text("".join(kept))
                os.replace(tmp, path)
        self.file = open(path, "a")

    @staticmethod
    def step_of(line):
        """The step of a metrics line; None for a line cut short by a crash."""
        try:
            return json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            return None

    def write(self, row):
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()


def placement(cfg):
    """Where each process runs. -> (trainer device, searcher devices, CPU threads per process)

    With G >= 2 GPUs the trainer takes cuda:0 and the searchers share cuda:1..G-1; with one GPU
    everything shares it. On CPU the cores are split evenly, because processes that each use
    every core slow each other down more than they gain.
    """
    trainer_device = torch.device(cfg.device)
    gpus = torch.cuda.device_count() if trainer_device.type == "cuda" else 0
    if gpus >= 2:
        searcher_devices = [f"cuda:{1 + i % (gpus - 1)}" for i in range(cfg.searchers)]
    else:
        searcher_devices = [str(trainer_device)] * cfg.searchers
    cores = os.cpu_count() or 1
    on_this_machine = cfg.ray in ("", "local")
    if trainer_device.type == "cpu" and on_this_machine and cfg.searchers > cores:
        raise ValueError(f"--searchers {cfg.searchers} needs at least one CPU core each but this "
                         f"machine has {cores}: use --searchers {cores} or fewer")
    return trainer_device, searcher_devices, max(1, cores // (cfg.searchers + 1))


def evaluate(task, model, tokenizer, ref_model, step, start, log, dtype):
    with models.autocast(next(model.parameters()).device, dtype):
        metrics = task.evaluate(model, tokenizer, ref_model, step=step)
    log.write({"step": step, "time": round(time.time() - start, 3), **metrics})
    tqdm.write(f"step {step}: " + " ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
    return metrics


@dataclass
class Setup:
    """What `load` prepares for `train`: everything that can fail on bad input."""
    device: torch.device
    searcher_devices: list
    threads: int                      # CPU threads per process
    task: tasks.Task
    policy: torch.nn.Module
    tokenizer: object
    ref_model: torch.nn.Module | None  # the frozen initial policy, if the trainer needs it
    prompts: list                     # the training prompts
    optimizer: torch.optim.Optimizer
    scheduler: object
    scaler: torch.amp.GradScaler      # loss scaling, on with --dtype float16 only
    schedule_steps: int               # the lr schedule's length: the run's first --steps
    resumed: dict | None              # the checkpoint's trainer state, on --resume
    buffer: ReplayBuffer | None       # asynchronous runs only; a checkpoint's groups on --resume
    source_state: dict | None         # the group source's checkpointed state, on --resume


def load(cfg):
    """Check the output folder, load the model, the data and the checkpoint: everything that can
    fail on bad input, so that it fails here, before anything is written."""
    device, searcher_devices, threads = placement(cfg)
    check_out_folder(cfg)
    if device.type == "cpu":
        torch.set_num_threads(threads)
    models.use_device(device)
    transformers_logging.disable_progress_bar()     # loading and saving bars: noise beside ours
    torch.manual_seed(cfg.seed)
    task = tasks.make_task(cfg)
    policy, tokenizer = task.load_model(device)
    trainer.check_output_layer(policy)
    if cfg.activation_checkpointing:
        trainer.enable_activation_checkpointing(policy)
    # Searchers score the reference log-probs themselves: then the trainer needs a reference
    # copy only if the task's evaluation does.
    ref_model = (copy.deepcopy(policy).requires_grad_(False)
                 if not cfg.searchers or task.eval_needs_reference else None)
    prompts = task.prompts("train", tokenizer)
    task.prompts("test", tokenizer)       # read now: a bad test file must not end the run later
    if cfg.searchers:
        check_shared_memory((0 if cfg.ray else trainer.WeightChannel.bytes_needed(policy))
                            + shared_bytes(cfg.buffer_capacity, cfg.group_size,
                                           max(len(p.ids) for p in prompts), cfg.max_new_tokens))
    resumed = buffer_state = None
    if cfg.resume:
        latest = checkpoint.latest(cfg.out)
        resumed, buffer_state = checkpoint.load(latest, policy)
    # The schedule is a function of the run's first --steps, so that going on past them (a
    # resume with a larger --steps) continues at the decayed rate instead of jumping back up.
    schedule_steps = resumed["schedule_steps"] if resumed else cfg.steps
    optimizer, scheduler = trainer.make_optimizer(policy, cfg.lr, schedule_steps,
                                                  cfg.warmup_steps, cfg.decay_steps)
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.dtype == "float16")
    if resumed:
        optimizer.load_state_dict(resumed["optimizer"])
        scheduler.load_state_dict(resumed["scheduler"])
        if resumed.get("scaler"):
            scaler.load_state_dict(resumed["scaler"])
    buffer = None
    if cfg.searchers:
        buffer = ReplayBuffer(cfg.buffer_capacity, cfg.group_size, max(len(p.ids) for p in prompts),
                              cfg.max_new_tokens, tokenizer.pad_token_id)
        if buffer_state is not None:
            try:
                buffer.load_state_dict(buffer_state, max_version=resumed["step"])
            except ValueError as e:
                raise checkpoint.CheckpointError(
                    f"{latest / 'buffer.pt'} is invalid ({e}): delete {latest} to resume from "
                    "the checkpoint before it") from None
    if cfg.ray:                           # last: nothing after it can fail on bad input
        sources.connect_ray(cfg.ray, cfg.searchers)
    return Setup(device, searcher_devices, threads, task, policy, tokenizer, ref_model, prompts,
                 optimizer, scheduler, scaler, schedule_steps, resumed, buffer,
                 resumed.get("source") if resumed else None)


class RunFailed(Exception):
    """The run stopped part-way for a reason other than bad input; the message says why."""


def train(cfg, setup):
    """Draw groups, take a trainer step, send the weights back, repeat. Where the groups come
    from (the trainer's own sampling, searcher processes or Ray actors) is the group source's
    business (`sources.py`). `setup` comes from `load(cfg)`."""
    task, policy, tokenizer, ref_model = setup.task, setup.policy, setup.tokenizer, setup.ref_model
    optimizer, scheduler, resumed = setup.optimizer, setup.scheduler, setup.resumed
    dtype = getattr(torch, cfg.dtype)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "config.json", run_record(cfg, setup.device, setup.searcher_devices,
                                               setup.threads))
    log = MetricsLog(out / "metrics.jsonl", resume_step=resumed["step"] if resumed else None)
    start_step = resumed["step"] if resumed else 0
    samples, tokens, groups = ((resumed["samples"], resumed["tokens"], resumed["groups"])
                               if resumed else (0, 0, 0))
    start = time.time() - (resumed["elapsed"] if resumed else 0.0)   # wall time spans sessions

    source = sources.make_source(cfg, setup, check_stop)
    done = start_step                        # the last step whose update is complete
    bar = tqdm(total=cfg.steps, initial=start_step, desc="train", unit="step", disable=cfg.quiet,
               dynamic_ncols=True)

    def save_checkpoint(step):
        source_state = source.state_dict()
        state = {"step": step, "samples": samples, "tokens": tokens, "groups": groups,
                 "elapsed": time.time() - start, "schedule_steps": setup.schedule_steps,
                 "task": task.state_dict(),
                 "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                 "scaler": setup.scaler.state_dict(),
                 "rng": {"torch": torch.get_rng_state(),
                         "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []},
                 "source": {k: v for k, v in source_state.items() if k != "buffer"}}
        path = checkpoint.save(out, step, policy, tokenizer, state, source_state.get("buffer"),
                               cfg.keep_checkpoints)
        if cfg.quiet:
            tqdm.write(f"step {step}: checkpoint {path}")
        return path

    try:
        if resumed:
            tqdm.write(f"resuming {out} at step {start_step}")
            if cfg.steps > setup.schedule_steps:
                tqdm.write(f"note: the learning-rate schedule was set for {setup.schedule_steps} "
                           f"steps; steps past them train at lr {scheduler.get_last_lr()[0]:.3g} "
                           "and below", file=sys.stderr)
        source.start(policy, version=start_step)
        if resumed:
            source.load_state_dict(setup.source_state)
            task.load_state_dict(resumed["task"])
            torch.set_rng_state(resumed["rng"]["torch"])
            if resumed["rng"]["cuda"] and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(resumed["rng"]["cuda"])
        else:                                    # the searchers fill the buffer meanwhile
            metrics = evaluate(task, policy, tokenizer, ref_model, 0, start, log, dtype)
        if source.fill_target:
            with tqdm(total=source.fill_target, desc="filling the buffer", unit="group",
                      disable=cfg.quiet, leave=False) as fill:
                source.fill(fill)
        last = time.time()
        tokens_before, groups_before = tokens, groups    # a resumed run's earlier sessions
        for step in range(start_step + 1, cfg.steps + 1):
            check_stop()
            version = step - 1                   # updates the policy has had before this step
            beta = trainer.beta_at(version, cfg.beta, cfg.beta_final, cfg.beta_steps)
            batch, source_metrics = source.next_batch(version)
            lr = scheduler.get_last_lr()[0]
            t0 = time.time()
            stats = trainer.train_step(policy, optimizer, scheduler, batch, beta, cfg.loss,
                                       cfg.temperature, cfg.micro_groups, cfg.max_grad_norm,
                                       cfg.micro_completions, dtype, setup.scaler)
            train_s = time.time() - t0
            sync_s = source.publish(policy, version=step) if step % cfg.sync_every == 0 else 0.0
            source.poll()
            tokens, groups = tokens_before + source.tokens, groups_before + source.groups
            samples += batch.reward.numel()
            now = time.time()
            staleness = (version - batch.version).float()
            row = {"step": step, "time": round(now - start, 3), "samples": samples, **stats,
                   "beta": beta, "lr": lr, "version": version,
                   "staleness_mean": staleness.mean().item(),
                   "staleness_max": staleness.max().item(),
                   **source_metrics, "sync_s": round(sync_s, 4), "train_s": round(train_s, 4),
                   "gen_groups": groups, "gen_tokens_per_s": round(tokens / (now - start), 2),
                   "samples_per_s": round(batch.reward.numel() / (now - last), 2),
                   **task.search_metrics(source.take_infos())}
            log.write(row)
            last, done = now, step
            bar.set_postfix(reward=f"{row['reward_mean']:.3f}", loss=f"{row['loss']:.3g}",
                            stale=f"{row['staleness_mean']:.1f}",
                            samples_s=f"{row['samples_per_s']:.1f}", refresh=False)
            bar.update()
            if cfg.save_every and step % cfg.save_every == 0 and step < cfg.steps:
                save_checkpoint(step)                 # the last step's is written below
            if (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.steps:
                metrics = evaluate(task, policy, tokenizer, ref_model, step, start, log, dtype)
        save_checkpoint(cfg.steps)
        checkpoint.save_pretrained(policy, tokenizer, out / "final")
    except KeyboardInterrupt:
        if stop_signals == 1 and done > start_step:   # stopped at a step boundary: keep it
            tqdm.write(f"saved {save_checkpoint(done)}; continue with: python tba.py --resume {out}")
        raise
    except (searcher.SearcherError, trainer.NonFiniteError) as e:
        raise RunFailed(f"after step {done}: {e}") from e
    except Exception as e:                    # a failure mid-run, not bad input: keep the trace
        (out / "error.log").write_text(traceback.format_exc())
        raise RunFailed(f"after step {done}: {type(e).__name__}: {e} (the traceback is in "
                        f"{out / 'error.log'})") from e
    finally:
        bar.close()
        source.close()
    summary = " ".join(f"{k}={v:.4g}" for k, v in metrics.items())
    print(f"final ({cfg.steps} steps, {time.time() - start:.0f} s, {samples} samples): {summary}")
    print(f"the trained model is in {out / 'final'} (AutoModelForCausalLM.from_pretrained loads it)")
    return metrics


stop_signals = 0


def request_stop(signum, frame):
    """Ctrl-C or `kill`: stop at the end of the current step, where no lock or queue is in use,
    and save a checkpoint there; a second one stops at once."""
    global stop_signals
    stop_signals += 1
    if stop_signals > 1:
        raise KeyboardInterrupt
    os.write(2, b"\nstopping after this step (press Ctrl-C again to stop at once)\n")


def check_stop():
    if stop_signals:
        raise KeyboardInterrupt


def main(argv=None):
    """The command line. Exit codes: 0 done, 2 bad input (one `error:` line, nothing written),
    1 the run failed part-way (the message says how to continue), 130 stopped by a signal."""
    global stop_signals
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["plot"]:
        return plot.main(argv[1:])
    try:
        cfg, given = parse_args(argv)
        cfg = resumed_config(cfg, given) if cfg.resume else resolve(cfg)
        setup = load(cfg)
    except (ValueError, models.ModelLoadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    stop_signals = 0
    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        train(cfg, setup)
    except RunFailed as e:
        latest = checkpoint.latest(cfg.out)
        print(f"error: {e}\nthe run stopped; metrics so far are in {cfg.out}/metrics.jsonl"
              + (f"; continue it from {latest.name} with: python tba.py --resume {cfg.out}"
                 if latest else ""), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"interrupted; metrics so far are in {cfg.out}/metrics.jsonl", file=sys.stderr)
        return 130
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


if __name__ == "__main__":
    sys.exit(main())
