"""How a setting is declared: `flag(default, help, valid)`, a dataclass field that carries its
--help text and the rule its value must follow. `config.Config` declares the core settings with
it, each option and each task its own (`tasks.Task.Settings`): one command line, one recipe
format (`read_recipe`), and a task's or a recipe's schedule fitted to a shorter run
(`fit_schedule`)."""
import argparse
import dataclasses
import math
import tomllib
from dataclasses import field
from pathlib import Path


def flag(default, help, valid=None, bare=None):
    """A settings field: its default, its --help text and, for numbers and choices, the rule its
    value must follow (`valid`), checked by `config.check_ranges` before anything is loaded. A
    flag with a `bare` value may be given without one (`--ray` means `--ray local`)."""
    return field(default=default, metadata={"help": help, "valid": valid, "bare": bare})


# Rules for `flag(valid=...)`: (test, how the valid values read in an error and in --help).
def at_least(low):
    return (lambda v: v >= low), f"at least {low}"


def within(low, high):
    return (lambda v: low <= v <= high), f"in [{low}, {high}]"


def one_of(*choices):
    return (lambda v: v in choices), "one of " + ", ".join(choices)


POSITIVE = (lambda v: v > 0), "greater than 0"
# Values that cannot train: AdamW moves each weight by about lr a step (above 1: noise), and
# β below 1e-4 puts rewards of order 1 at 10,000 nats, past what the loss's precision holds.
LEARNING_RATE = (lambda v: 0 < v <= 1), "greater than 0 and at most 1"
BETA = (lambda v: 1e-4 <= v < math.inf), "at least 0.0001 and finite"
TASK_DEFAULT = "(default: the task's choice)"


KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
         list: "two numbers, [LOW, HIGH]"}


def read_recipe(path, fields):
    """A recipe's flags, type- and range-checked against `fields` ({name: the flag's field}).
    -> {field name: value}

    Keys are flag names without the dashes (`group-size`, or `group_size`); values have the
    flag's type (TOML integers are accepted where a float goes)."""
    try:
        recipe = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"--config {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--config {path}: cannot read it ({e})") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"--config {path} is not valid TOML ({e})") from None
    values = {}
    for key, value in recipe.items():
        name = key.replace("-", "_")
        if name not in fields or name == "resume":
            raise ValueError(f"{path}: unknown key {key!r}: keys are the flags of python tba.py "
                             "--help without their dashes, e.g. group-size = 8")
        if name in values:
            raise ValueError(f"{path}: {key!r} is set twice (as {name.replace('_', '-')} and "
                             f"{name}): keep one")
        kind = fields[name].type
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        pair = isinstance(value, list) and len(value) == 2 and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
        if kind is list and pair:
            value = [float(v) for v in value]
        if type(value) is not kind or (kind is list and not pair):
            raise ValueError(f"{path}: {key} = {value!r} must be {KINDS[kind]}")
        valid = fields[name].metadata["valid"]
        if valid and not passes(valid, value):
            raise ValueError(f"{path}: {key} = {value!r} must be {valid[1]}")
        values[name] = value
    return values


def passes(valid, value):
    """A value against its field's rule: NaN and infinities never pass, whatever the rule."""
    test, _ = valid
    numbers = value if isinstance(value, list) else [value]
    return (not any(isinstance(v, float) and not math.isfinite(v) for v in numbers)
            and bool(test(value)))


# Command-line actions, not settings of the run: they are not stored in its config.json.
ACTIONS = {"config": "read flags from a recipe, a TOML file whose keys are flag names "
                     "(prompts-per-step = 4); flags on the command line override it",
           "dry_run": "print the resolved settings, checked, and exit without loading or "
                      "writing anything"}


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):
        """argparse's own errors (an unknown flag, a word where a number goes) follow the rule
        of every other bad input: one line, exit 2, from `main`."""
        raise ValueError(f"{message} (see python tba.py --help)")


def command_line(description, epilog, fields, groups, with_defaults=True):
    """An argparse parser with a flag per settings field: `fields` first, then each of
    `groups` ({heading: fields}) under its heading, then the ACTIONS. with_defaults False: a
    flag not given is absent from the result (which flags were given)."""
    parser = ArgumentParser(description=description, epilog=epilog)
    for f in fields:
        add_flag(parser, f, with_defaults)
    for heading, grouped in groups.items():
        group = parser.add_argument_group(heading)
        for f in grouped:
            add_flag(group, f, with_defaults)
    parser.add_argument("--config", metavar="FILE.toml", default=None if with_defaults
                        else argparse.SUPPRESS, help=ACTIONS["config"])
    parser.add_argument("--dry-run", action="store_true", default=False if with_defaults
                        else argparse.SUPPRESS, help=ACTIONS["dry_run"])
    return parser


def add_flag(parser, f, with_defaults):
    """One settings field as a command-line flag."""
    name = "--" + f.name.replace("_", "-")
    valid = f.metadata["valid"]
    help = (f.metadata["help"] + (f"; {valid[1]}" if valid else "")
            + (f" (default: {f.default})" if f.default not in (None, "") else ""))
    default = f.default if with_defaults else argparse.SUPPRESS
    if f.type is bool:               # on/off, or --x/--no-x when the task chooses
        action = "store_true" if f.default is False else argparse.BooleanOptionalAction
        parser.add_argument(name, action=action, default=default, help=f.metadata["help"])
    elif f.type is list:             # two numbers
        parser.add_argument(name, type=float, nargs=2, metavar=("LOW", "HIGH"),
                            default=default, help=help)
    else:
        kind = {"int": int, "float": float, "str": str}[f.type.__name__]
        bare = {"nargs": "?", "const": f.metadata["bare"]} if f.metadata["bare"] else {}
        parser.add_argument(name, type=kind, default=default, help=help, **bare)


def task_named_in(argv):
    """The --task of a command line, if it names one, read before the whole line is parsed."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--task")
    return pre.parse_known_args(argv)[0].task


def wrapped(groups, width=100):
    """Settings printed by group, `{title: ["name=value", ...]}`, each group's line wrapped at
    `width` characters. -> lines"""
    lines = []
    for title, items in groups.items():
        line = f"  {title}:"
        for item in items:
            if len(line) + 1 + len(item) > width:
                lines.append(line)
                line = " " * (len(title) + 3)
            line += " " + item
        lines.append(line)
    return lines


# --- fitting a task's or a recipe's schedule to the run's --steps ------------------------------
# The learning-rate and β schedules (and the reward temperature's): all must fit in --steps.
SCHEDULE = ("warmup_steps", "decay_steps", "beta_steps", "reward_temp_steps")


def planned_length(planned, recipe_steps, task_steps):
    """The run length a task's or recipe's schedule (`planned`: its SCHEDULE values) was made
    for: the recipe's steps, else the task's, the first that the schedule fits; else the
    shortest run it fits. So a recipe copied with a smaller `steps` and its schedule left as it
    was has that schedule fitted as `--steps` on the command line would fit it."""
    span = max(planned["warmup_steps"] + planned["decay_steps"], planned["beta_steps"],
               planned["reward_temp_steps"] or 0)
    return next((n for n in (recipe_steps, task_steps) if n and n >= span), span)


def fit_schedule(cfg, from_task, task_steps):
    """Warm-up + decay, and β's annealing, must fit in --steps: a trial run shorter than the
    task's (or the recipe's) gets that schedule shrunk in proportion (shown by `describe`); a
    schedule given on the command line that does not fit is refused, not trained silently at a
    fraction of the peak lr. from_task: the SCHEDULE fields the task or the recipe chose;
    task_steps: the run length they were chosen for."""
    def fits(c):
        return (c.warmup_steps + c.decay_steps <= c.steps and c.beta_steps <= c.steps
                and c.reward_temp_steps <= c.steps)
    if fits(cfg):
        return cfg
    scale = cfg.steps / task_steps
    cfg = dataclasses.replace(cfg, **{name: round(getattr(cfg, name) * scale)
                                      for name in SCHEDULE if name in from_task})
    if "reward_temp_steps" in from_task and cfg.reward_temp_steps == 0:
        cfg.reward_temp_steps = 1         # not 0, which would hold τ for the whole run
    if cfg.warmup_steps + cfg.decay_steps > cfg.steps:
        raise ValueError(f"the learning-rate schedule does not fit in --steps {cfg.steps}: "
                         f"--warmup-steps {cfg.warmup_steps} + --decay-steps {cfg.decay_steps} "
                         f"= {cfg.warmup_steps + cfg.decay_steps}: shorten them or train longer")
    if cfg.beta_steps > cfg.steps:
        raise ValueError(f"--beta-steps {cfg.beta_steps} is longer than the run's --steps "
                         f"{cfg.steps}: β would never reach --beta-final; use --beta-steps "
                         f"{cfg.steps} or fewer")
    if cfg.reward_temp_steps > cfg.steps:
        raise ValueError(f"--reward-temp-steps {cfg.reward_temp_steps} is longer than the run's "
                         f"--steps {cfg.steps}: τ would never reach 1; use --reward-temp-steps "
                         f"{cfg.steps} or fewer")
    return cfg


def fitted_note(cfg, fitted, planned, from_recipe):
    """The settings printout's line for a schedule `fit_schedule` shrank: `fitted`, the names it
    changed; `planned`, the values and the run length (`steps`) they were made for."""
    return (f"  fitted to --steps {cfg.steps}: the {'recipe' if from_recipe else 'task'}'s "
            "schedule (" + ", ".join(f"{n.replace('_', '-')} {planned[n]}" for n in fitted)
            + f") is for {planned['steps']} steps")
