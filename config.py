"""The settings of a run: every flag, where its value comes from, and the checks it must pass.

A value comes from, in order of precedence: the command line, a recipe (`--config FILE.toml`,
keys are the flag names), the task's choice (the flags whose default reads "the task's
choice"), the flag's own default. Every rule is checked here, before anything is loaded or
written: a bad value is one `error:` line (exit 2) that says how to fix it.

    cfg, given, actions = parse_args(argv)    # `given`: the fields the user set
    cfg = resolve(cfg)                         # the task's choices filled in, everything checked
    print(describe(cfg, given))               # what this run will use
"""
import dataclasses
import functools
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import tasks
from devices import placement
from llm import models, precision
from plumbing import checkpoint, flags, loggers
from plumbing import run as run_files
from options import exploration, learned_log_z, lora, losses, policy_lag, replay_groups, rloo
from replay import storage
from plumbing.flags import (BETA, LEARNING_RATE, POSITIVE, TASK_DEFAULT, at_least, flag,
                            one_of, within)


# What may change when a run is resumed: how long it goes on, how it is watched and where it
# runs. Everything else would make the resumed run a different experiment.
RESUME_OVERRIDES = ("steps", "eval_every", "eval_n", "eval_batch_size", "eval_samples",
                    "save_every", "keep_checkpoints", "quiet", "report_to", "searchers", "ray",
                    "device", "micro_groups", "micro_completions", "activation_checkpointing",
                    "dtype")


@dataclass
class Config:
    # what to train
    task: str = flag("toy", "task to train on: " + ", ".join(tasks.TASKS)
                            + ", or your own Task subclass as module:Class")
    model: str = flag("", "hub id, local HF folder or .gguf file (default: the task's model, "
                          f"{models.DEFAULT_MODEL} for language tasks)")
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
    loss: str = flag("tb", "; ".join(f"{name} ({what})" for name, what in losses.HELP.items()),
                     (losses.valid,
                      "one of " + ", ".join(losses.LOSSES) + " (tb-trust:λ with λ > 0)"))
    beta: float = flag(None, f"β at step 0: the target is p_ref·exp(r/β) {TASK_DEFAULT}", BETA)
    beta_final: float = flag(None, f"β after annealing {TASK_DEFAULT}", BETA)
    beta_steps: int = flag(None, f"steps over which β goes linearly to beta_final {TASK_DEFAULT}",
                           at_least(0))
    reward_temp: float = flag(1.0, "--loss tb: τ at step 0, annealed linearly to 1 over "
                                   "--reward-temp-steps: the target is (p_ref·exp(r/β))^(1/τ), "
                                   "flatter while τ > 1 (GFlowNet red-teaming: 2 → 1 over the "
                                   "first tenth of the run)", at_least(1))
    reward_temp_steps: int = flag(0, "steps over which --reward-temp goes linearly to 1 (0: "
                                     "held at --reward-temp)", at_least(0))
    # the optimiser
    lr: float = flag(None, f"peak learning rate (AdamW) {TASK_DEFAULT}", LEARNING_RATE)
    warmup_steps: int = flag(None, f"linear warm-up steps of the WSD schedule {TASK_DEFAULT}",
                             at_least(0))
    decay_steps: int = flag(None, "final steps of linear decay to --lr-final (WSD); the schedule is set by "
                                  "the run's first --steps, so a resumed run that goes on past "
                                  f"them continues at the decayed rate {TASK_DEFAULT}", at_least(0))
    lr_final: float = flag(0.0, "the learning-rate multiplier the decay ends at (0: to 0). "
                                "GFlowNet red-teaming counts its schedule's horizon in "
                                "gradient-accumulation steps (8 a step), so its lr ends at 0.88 of "
                                "the peak: --decay-steps over the run and --lr-final 0.88 is it",
                        within(0, 1))
    weight_decay: float = flag(0.0, "AdamW's decoupled weight decay (torch's default 0.01 is "
                                    "GFlowNet red-teaming's; 0: none)", within(0, 1))
    micro_groups: int = flag(None, "groups per forward/backward pass, gradients accumulated; "
                                   "bounds the trainer's memory (0: all at once, on a GPU as "
                                   "many as its memory holds: devices/memory.py) "
                                   "(default: the task's choice on a CPU, 0 on a GPU)",
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
                              "float32; auto: bfloat16 on GPUs that have it and on CPUs that "
                              "have it natively and measure faster in it, else float32",
                      one_of("auto", "float32", "bfloat16", "float16"))
    max_grad_norm: float = flag(1.0, "clip the gradient norm to this (0: no clipping)", at_least(0))
    # asynchrony
    searchers: int = flag(None, "searcher processes; 0 runs the synchronous on-policy loop "
                                "(default: GPUs - 1, at least 1; 0 with --lag)", at_least(0))
    ray: str = flag("", "run the searchers as Ray actors: 'local' (or --ray alone) starts a Ray "
                        "cluster on this machine, 'auto' joins the one `ray start` made, "
                        "HOST:PORT or ray://HOST:PORT another; the trainer stays here "
                        "(pip install 'ray==2.60.0')", bare="local")
    search_batch: int = flag(0, "prompts a searcher generates for in one call (0: B, "
                                "--prompts-per-step): more rows a decode step cost a GPU little "
                                "more time while it is bound by the host, so a searcher may "
                                "search for several steps at once; searcher processes only",
                             at_least(0))
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
    buffer_capacity: int = flag(None, "completions the replay buffer holds (groups are formed "
                                      f"from them when drawn) {TASK_DEFAULT}", at_least(1))
    buffer_per_prompt: int = flag(0, "completions the buffer holds of one prompt at most (TBA "
                                     "keeps 100); 0: no bound but --buffer-capacity",
                                  ((lambda v: v == 0 or v >= 2), "0 or at least 2"))
    buffer_evict: str = flag("oldest", "which completion makes room when the buffer (or a "
                                       "prompt's share) is full: oldest, or lowest reward "
                                       "(GFlowNet red-teaming: the best stay)",
                             one_of("oldest", "lowest"))
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
    save_every: int = flag(None, "write a checkpoint (weights, optimiser, replay buffer: what "
                                 "--resume needs) every this many steps and at the end; 0: only "
                                 "on Ctrl-C, the trained model still goes to final/ "
                                 f"{TASK_DEFAULT}", at_least(0))
    keep_checkpoints: int = flag(2, "how many of the newest checkpoints stay on disk (0: all)",
                                 at_least(0))
    resume: str = flag("", "continue the run in this folder from its newest checkpoint with its "
                           "settings; only " + ", ".join("--" + f.replace("_", "-")
                                                        for f in RESUME_OVERRIDES)
                           + " may be given again, to change them")
    quiet: bool = flag(False, "no progress bars: log lines only")
    report_to: str = flag("", "also send every metrics row to these loggers, comma-separated: "
                              "tensorboard (runs/<name>/tensorboard), wandb (online once logged "
                              "in, or WANDB_MODE=offline); install them with "
                              f"`{loggers.INSTALL}`",
                          ((lambda v: len(set(loggers.names(v))) == len(loggers.names(v))
                            and set(loggers.names(v)) <= set(loggers.CHOICES)),
                           "tensorboard, wandb or tensorboard,wandb"))
    seed: int = flag(0, "random seed", within(0, 2**32 - 1))
    device: str = flag("auto", "the trainer's device: auto (cuda:0 if there is a GPU, else "
                               "cpu), cpu or cuda:N; with 2+ GPUs the searchers take the others")


# The options, each with its own settings (`Settings`) and the rules that tie them to the others
# (`check(cfg)`), in the order --help lists them: options/, and the buffer's storage policies.
OPTIONS = (exploration, rloo, learned_log_z, lora, policy_lag, replay_groups, storage)


@functools.cache
def settings_class(task):
    """The dataclass of a run of `task`: Config's fields, each option's (`OPTIONS`), then the
    task's own (`Task.Settings`). Its instances pickle as their values, so that a spawned
    searcher rebuilds the class."""
    own = tasks.task_class(task).Settings
    return dataclasses.make_dataclass(
        f"{own.__name__}AndConfig", [],
        bases=(own, *reversed([option.Settings for option in OPTIONS]), Config),
        namespace={"__reduce__": lambda self: (rebuilt, (dataclasses.asdict(self),)),
                   "__module__": __name__})


def rebuilt(values):
    """Unpickling a run's settings: their class is made at run time, so they travel as values."""
    return settings(**values)


def settings(**values):
    """A run's settings from flag values (those its task does not declare left out). -> the
    instance of `settings_class(values["task"])`"""
    cls = settings_class(values.get("task", "toy"))
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in names})


def option_fields():
    """Every option's settings: -> {name: (field, the option's Settings class)}, in the order of
    OPTIONS."""
    return {f.name: (f, option.Settings) for option in OPTIONS
            for f in dataclasses.fields(option.Settings)}


def all_fields(own_task=None):
    """Every setting a run of some task may have: -> {name: field}"""
    return {**{f.name: f for f in dataclasses.fields(Config)},
            **{name: f for name, (f, _) in {**option_fields(), **task_fields(own_task)}.items()}}


def task_fields(own_task=None):
    """Every task's own settings, once each, with the Settings class that declares it first:
    -> {name: (field, class)}, in the order of tasks.TASKS, then `own_task`'s (a module:Class)."""
    found = {}
    for name in [*tasks.TASKS, *([own_task] if own_task and ":" in own_task else [])]:
        for cls in reversed(tasks.task_class(name).Settings.__mro__):
            if dataclasses.is_dataclass(cls):
                for f in dataclasses.fields(cls):
                    if f.name in cls.__dict__.get("__annotations__", {}):
                        found.setdefault(f.name, (f, cls))
    return found


# The groups in which `describe` prints the settings: each starts at its first field.
SECTIONS = {"task": "what to train", "steps": "how much", "loss": "the objective",
            "lr": "the optimiser", "searchers": "asynchrony", "eval_every": "evaluation and output"}
def build_parser(with_defaults=True, own_task=None):
    """The command line: Config's flags, then each option's and each task's under its heading
    (`own_task`, a module:Class, brings its own)."""
    groups = {}
    for f, cls in [*option_fields().values(), *task_fields(own_task).values()]:
        groups.setdefault("settings of " + cls.__doc__.strip().rstrip("."), []).append(f)
    return flags.command_line(
        "tba: Trajectory Balance with Asynchrony, on one machine",
        "python tba.py plot RUN [RUN ...] draws the curves of one or several runs",
        dataclasses.fields(Config), groups, with_defaults)


def parse_args(argv=None):
    """-> (Config, names of the fields set by the command line or the recipe, actions)

    actions: {"config": the recipe's path or None, "dry_run": bool, "recipe": the recipe's
    values that the command line left in place ({} without one)}."""
    argv = sys.argv[1:] if argv is None else list(argv)
    named = [a.split("=")[0] for a in argv if a.startswith("--") and len(a) > 2]
    twice = sorted({a for a in named if named.count(a) > 1})
    if twice:                        # argparse would keep the last silently; a recipe refuses
        raise ValueError(f"{twice[0]} is given twice: keep one")
    task = flags.task_named_in(argv)              # your own module:Class brings its flags
    values = vars(build_parser(own_task=task).parse_args(argv))
    given = set(vars(build_parser(with_defaults=False, own_task=task).parse_args(argv)))
    actions = {name: values.pop(name) for name in flags.ACTIONS}
    given -= set(flags.ACTIONS)
    actions["recipe"], actions["recipe_steps"] = {}, None
    if actions["config"]:
        recipe = flags.read_recipe(actions["config"], all_fields())
        actions["recipe"] = {name: value for name, value in recipe.items() if name not in given}
        actions["recipe_steps"] = recipe.get("steps")     # what its schedule was planned for
        values.update(actions["recipe"])
        given |= set(recipe)
    names = {f.name for f in dataclasses.fields(settings_class(values["task"]))}
    for name in sorted(given - names):
        owners = [t for t in tasks.TASKS
                  if name in {f.name for f in dataclasses.fields(tasks.task_class(t).Settings)}]
        where = (f"{actions['config']}: {name.replace('_', '-')}" if name in actions["recipe"]
                 else f"--{name.replace('_', '-')}")
        raise ValueError(f"{where} is a setting of {', '.join(owners)}, not of --task "
                         f"{values['task']}: drop it, or train {owners[0]}")
    return settings(**values), given, actions


def check_ranges(cfg):
    """Every field against its own rule."""
    for f in dataclasses.fields(cfg):
        value, valid = getattr(cfg, f.name), f.metadata["valid"]
        if value is not None and valid is not None and not flags.passes(valid, value):
            raise ValueError(f"--{f.name.replace('_', '-')} must be {valid[1]} (got {value})")


# Settings that act only with another: given on the command line without it, they would be
# printed and recorded as if they counted. (name, does it act in run c?, on what, why not, fix)
BUFFERED = lambda c: c.searchers or c.replay_groups          # noqa: E731
NEEDS = [
    ("sync_every", lambda c: c.searchers, "the searchers", "--searchers is 0",
     "use --searchers 1 or more, or "),
    ("max_staleness", BUFFERED, "a replay buffer", "--searchers 0 has none",
     "use --searchers 1 or more or --replay-groups, or "),
    ("priority_temp", BUFFERED, "a replay buffer", "--searchers 0 has none",
     "use --searchers 1 or more or --replay-groups, or "),
    *(rule for option in OPTIONS for rule in getattr(option, "NEEDS", ())),   # each option's
    ("model", lambda c: tasks.task_class(c.task).reads_model, "the policy it loads",
     "this task builds its own model", ""),
    ("trust_remote_code", lambda c: tasks.task_class(c.task).reads_model, "the model it loads",
     "this task builds its own model", ""),
]


def check_given(cfg, given):
    """Every setting given on the command line (`given`, their names; a recipe's keys may be
    general) acts in this run: one `NEEDS` rule for each setting that acts only with another."""
    for name, acts, on, why_not, fix in NEEDS:
        if name in given and not acts(cfg):
            raise ValueError(f"--{name.replace('_', '-')} acts on {on}, and {why_not}: {fix}"
                             "drop it")


def check_combination(cfg):
    """The rules that tie fields together."""
    task = tasks.task_class(cfg.task)
    task.check_settings(cfg)
    for option in OPTIONS:
        option.check(cfg)
    waits_for = max(cfg.min_buffer, cfg.prompts_per_step) * cfg.group_size
    if cfg.search_batch and not cfg.searchers:
        raise ValueError(f"--search-batch {cfg.search_batch} sizes a searcher process's calls, "
                         "and --searchers 0 samples each step's B groups itself: drop it, or "
                         "use --searchers 1 or more")
    if cfg.reward_temp != 1 and not cfg.loss.startswith("tb"):     # tb and its stale forms
        raise ValueError(f"--reward-temp {cfg.reward_temp} shapes trajectory balance's target, "
                         f"and --loss is {cfg.loss}: use --loss tb, or drop it")
    buffered = cfg.searchers or cfg.replay_groups
    if buffered and cfg.buffer_capacity < waits_for:
        raise ValueError(f"--buffer-capacity {cfg.buffer_capacity} is below the {waits_for} "
                         "completions the trainer waits for (--min-buffer or --prompts-per-step, "
                         "times --group-size): raise it")
    if buffered and 0 < cfg.buffer_per_prompt < cfg.group_size:
        raise ValueError(f"--buffer-per-prompt {cfg.buffer_per_prompt} is below --group-size "
                         f"{cfg.group_size}: a prompt could not hold the group it was searched "
                         "with; raise it, or use 0")
    if 0 <= cfg.max_staleness < cfg.sync_every - 1:
        raise ValueError(f"--max-staleness {cfg.max_staleness} is below --sync-every - 1 = "
                         f"{cfg.sync_every - 1}: searchers could never produce data fresh enough")
    if cfg.merge_cosine and not task.embeds_completions:
        raise ValueError(f"--merge-cosine needs a task that embeds its completions (redteam), "
                         f"not {cfg.task}: drop it")
    loggers.check(cfg.report_to)
    placement.check(cfg)


def resolve(cfg, recipe=None, measure=True, recipe_steps=None):
    """Fill the fields left unset with the task's defaults (and the machine's), fit the schedule
    to the run, and check every value and the combination. `recipe`: the values a recipe set
    (`parse_args`' actions["recipe"]): its schedule is fitted as the task's would be. `measure`
    False (--dry-run): --dtype auto on a CPU stays auto instead of timing a matmul to choose.
    `recipe_steps`: the recipe's --steps, the run its schedule was planned for, even when the
    command line trains for another number of steps."""
    recipe = recipe or {}
    if type(cfg) is not settings_class(cfg.task):          # e.g. a Config built in code
        cfg = settings(**dataclasses.asdict(cfg))
    names = {f.name for f in dataclasses.fields(cfg)}
    task_defaults = {k: v for k, v in tasks.task_class(cfg.task).defaults.items() if k in names}
    from_task = {k for k in task_defaults if getattr(cfg, k) is None}
    cfg = dataclasses.replace(cfg, **{k: task_defaults[k] for k in from_task})
    if cfg.device == "auto":
        cfg.device = placement.default_device()
    elif cfg.device.startswith("cuda") and placement.gpu_count():
        cfg.device = placement.indexed(cfg.device)      # cuda -> cuda:0
    gpu = cfg.device.startswith("cuda") and placement.gpu_count() > 0
    if gpu and "micro_groups" in from_task:        # a pass per group costs a GPU host time
        cfg.micro_groups = 0
    if cfg.dtype == "auto" and (gpu or measure):   # bfloat16 where it is native and faster
        cfg.dtype = ("bfloat16" if (gpu and torch.cuda.is_bf16_supported())
                     or (cfg.device == "cpu" and precision.cpu_bfloat16_is_faster()) else "float32")
    if cfg.searchers is None and cfg.lag:
        cfg.searchers = 0                 # a lag is the synchronous loop's
    elif cfg.searchers is None:
        cfg.searchers = max(1, placement.gpu_count() - 1) if cfg.device.startswith("cuda") else 1
    if not cfg.out:
        cfg.out = f"runs/{cfg.task}-{time.strftime('%Y%m%d-%H%M%S')}"
    check_ranges(cfg)
    if not cfg.resume:          # a resumed run keeps the schedule of its first session
        planned = {**dataclasses.asdict(cfg), **task_defaults, **recipe}   # the task's plan
        planned_for = flags.planned_length(planned, recipe_steps, task_defaults.get("steps"))
        cfg = flags.fit_schedule(cfg, from_task | (set(flags.SCHEDULE) & set(recipe)),
                                 planned_for)
    check_combination(cfg)
    return cfg


def describe(cfg, given, width=100, recipe=None, recipe_steps=None):
    """The settings a run uses, compactly: by group, only those that differ from the flags'
    defaults; * marks a choice of the task (or of the machine: device, dtype, searchers), and a
    task's or recipe's schedule fitted to a shorter run says so. On --resume, the run's saved
    settings."""
    recipe = recipe or {}
    task_defaults = tasks.task_class(cfg.task).defaults
    planned = {**dataclasses.asdict(cfg), **task_defaults, **recipe}
    planned["steps"] = flags.planned_length(planned, recipe_steps, task_defaults.get("steps"))
    groups, title = {}, None
    own = {f.name for f in dataclasses.fields(tasks.task_class(cfg.task).Settings)}
    options = {name: cls.__doc__.split(" (")[0] for name, (_, cls) in option_fields().items()}
    for f in dataclasses.fields(cfg):
        title = (f"{cfg.task}'s own" if f.name in own
                 else options.get(f.name) or SECTIONS.get(f.name, title))
        value = getattr(cfg, f.name)
        if value != f.default and f.name not in ("task", "resume", "out"):
            mark = "*" if not cfg.resume and f.name not in given else ""
            groups.setdefault(title, []).append(f"{f.name.replace('_', '-')}={value}{mark}")
    if cfg.resume:
        lines = [f"resuming {cfg.out} (task {cfg.task}) with its settings:"]
    else:
        lines = [f"run {cfg.out}, task {cfg.task} (* the task's or the machine's choice; the "
                 "rest as in --help):"]
    lines += flags.wrapped(groups, width)
    fitted = [name for name in flags.SCHEDULE if (name not in given or name in recipe)
              and getattr(cfg, name) != planned.get(name, getattr(cfg, name))]
    if fitted and not cfg.resume:
        lines.append(flags.fitted_note(cfg, fitted, planned, set(fitted) & set(recipe)))
    return "\n".join(lines)


# ---------------------------------------------------------------- the settings of a resumed run
def read_run_config(run):
    """The settings stored in a run folder's config.json, checked against this version's."""
    saved = run_files.saved_settings(run)
    try:
        fields = {f.name for f in dataclasses.fields(settings_class(saved.get("task", "toy")))}
    except ValueError as e:              # e.g. your own task's module is not importable here
        raise ValueError(f"{run} was trained on a task that cannot be loaded here: {e}") from None
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
    allowed = ", ".join("--" + f.replace("_", "-") for f in RESUME_OVERRIDES)
    for name in sorted(given - {"resume"}):
        if name not in RESUME_OVERRIDES and getattr(cfg, name) != saved[name]:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(cfg, name)} differs from the "
                             f"resumed run's {saved[name]}: on resume only {allowed} may change; "
                             "start a new run (--out) to change the rest")
    latest = checkpoint.latest(run)
    if latest is None:
        raise ValueError(f"{run} has no checkpoint to resume from (it stopped before its first "
                         f"one): start it again, with --out {run} if it trained no step, else "
                         "with another --out")
    overrides = {name: getattr(cfg, name) for name in given if name in RESUME_OVERRIDES}
    cfg = resolve(settings(**{**saved, **overrides, "resume": str(run),
                                          "out": str(run)}))
    if checkpoint.step_of(latest) >= cfg.steps:
        raise ValueError(f"{run} is already at step {checkpoint.step_of(latest)}: pass --steps "
                         "with a larger number to train it further")
    return cfg
