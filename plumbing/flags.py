"""How a setting is declared: `flag(default, help, valid)`, a dataclass field that carries its
--help text and the rule its value must follow. `config.Config` declares the core settings with
it, each option and each task its own (`tasks.Task.Settings`): one command line, one recipe
format (`read_recipe`)."""
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
