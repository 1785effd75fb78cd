"""How a setting is declared: `flag(default, help, valid)`, a dataclass field that carries its
--help text and the rule its value must follow. `config.Config` declares the core settings with
it, and each task its own (`tasks.Task.Settings`): one command line, one recipe format."""
import math
from dataclasses import field


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
