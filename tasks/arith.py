"""Arithmetic word problems, generated: a real task that a small model learns on a laptop.

    Mia has 47 stickers. She gives 12 to a friend. She buys 3 boxes with 8 stickers in each.
    How many stickers does Mia have now?

Three knobs set the difficulty: --arith-digits (numbers have up to that many digits),
--arith-steps (operations after the first sentence) and --arith-ops (which operations: "+"
buys more, "-" gives some away, "*" buys boxes of a given size). The problems are drawn with a
fixed seed that depends only on the knobs, so every run (and every process) sees the same
5,000 training and 200 test problems, and no test question is among the training ones.
Prompts, reward and evaluation are the ones of GSM8K (`tasks.answers`).
"""
import functools
import random

from dataclasses import dataclass

from plumbing.flags import TASK_DEFAULT, within, flag
from tasks import PromptSettings
from tasks.answers import AnswerTask

TRAIN_SIZE, TEST_SIZE = 5000, 200
NAMES = [("Tom", "he", "him"), ("Mia", "she", "her"), ("Sam", "he", "him"), ("Ana", "she", "her"),
         ("Leo", "he", "him"), ("Zoe", "she", "her"), ("Ben", "he", "him"), ("Eva", "she", "her")]
ITEMS = ["apples", "marbles", "stickers", "books", "coins", "pencils", "cookies", "stamps"]
SENTENCES = {
    "+": ["{He} buys {n} more.", "{He} finds {n} more.", "A friend gives {him} {n} more."],
    "-": ["{He} gives {n} to a friend.", "{He} loses {n}.", "{He} sells {n}."],
    "*": ["{He} buys {k} boxes with {n} {item} in each."],
}


def make_problem(rng, digits, steps, ops):
    """One problem -> (question, answer). Numbers have 1..`digits` digits, box counts one digit,
    and nothing is given away that is not there, so every intermediate count is positive."""
    name, he, him = rng.choice(NAMES)
    item = rng.choice(ITEMS)
    largest = 10 ** digits - 1
    total = rng.randint(2, largest)                # "1 apples" would read badly
    sentences = [f"{name} has {total} {item}."]
    for _ in range(steps):
        op = rng.choice(ops)
        if op == "-" and total < 2:
            op = "+"
        n = rng.randint(1, min(largest, total - 1) if op == "-" else largest)
        k = rng.randint(2, 9)
        total += {"+": n, "-": -n, "*": k * n}[op]
        sentences.append(rng.choice(SENTENCES[op]).format(He=he.capitalize(), him=him, n=n, k=k,
                                                           item=item))
    sentences.append(f"How many {item} does {name} have now?")
    return " ".join(sentences), str(total)


@functools.cache
def make_splits(digits, steps, ops):
    """{"train": [(question, answer)] * 5000, "test": [...] * 200}, the same in every process."""
    if digits < 1 or steps < 1 or not ops or set(ops) - set(SENTENCES):
        raise ValueError(f"arith needs --arith-digits >= 1, --arith-steps >= 1 and --arith-ops "
                         f"made of + - * (got {digits}, {steps}, {ops!r})")
    rng = random.Random(f"arith-{digits}-{steps}-{ops}")      # independent of --seed on purpose
    test = [make_problem(rng, digits, steps, ops) for _ in range(TEST_SIZE)]
    seen = {q for q, _ in test}
    train = []
    while len(train) < TRAIN_SIZE:
        question, answer = make_problem(rng, digits, steps, ops)
        if question not in seen:
            seen.add(question)
            train.append((question, answer))
    return {"train": train, "test": test}


@dataclass
class ArithSettings(PromptSettings):
    """arith: the problems it makes."""
    arith_digits: int = flag(None, f"arith: numbers have up to this many digits {TASK_DEFAULT}",
                             within(1, 9))
    arith_steps: int = flag(None, f"arith: operations per problem {TASK_DEFAULT}", within(1, 20))
    arith_ops: str = flag(None, f"arith: operations to draw from, e.g. +- or +-* {TASK_DEFAULT}",
                          ((lambda v: v and set(v) <= set("+-*")), "made of + - *"))


class ArithTask(AnswerTask):
    name = "arith"
    Settings = ArithSettings
    # SmolLM2-135M-Instruct on a 2-core CPU: one-step problems (1 digit, + or -), reward 1 for the
    # right number (tasks.answers), greedy accuracy on 128 of the 200 test problems. The defaults:
    # - The number only, in 32 new tokens: it starts at 0.367 and a step is short; asked to reason
    #   step by step in 128 tokens, a step took ~50 s and 20 steps did not move it (0.25 -> 0.20).
    # - 100 steps at lr 1e-5 (TBA's GSM8K rate): at 3e-5 the samples collapsed onto one answer per
    #   problem and fell 13-20 points from their best (0.789 ± 0.088, 2 seeds; 864a9c4).
    # - β 0.05 (r/β = 20 for a right answer), not 0.2: synchronous TB ends at 0.966 ± 0.027
    #   [0.930–0.992] against 0.923 ± 0.036, 5 seeds each (bench/compare.py arith, d83d549).
    # - max_reuse 1: training each group once lifted one searcher from 0.638 ± 0.068 (reuse 4) to
    #   0.820 ± 0.081, 3 seeds (25 steps at lr 3e-5, β 0.05; 876c5fc).
    # - micro_groups 1: one group a backward pass peaks at 3.77 against 5.01 GiB in 0.990x the
    #   time (bench/memory.py arith, 2e778a1).
    instruction = "Reply with only the final number."
    defaults = dict(AnswerTask.defaults, arith_digits=1, arith_steps=1, arith_ops="+-", steps=100,
                    max_new_tokens=32, temperature=0.7, warmup_steps=5, decay_steps=10,
                    eval_every=10, eval_n=128, min_buffer=4, buffer_capacity=4000, max_reuse=1,
                    micro_groups=1, save_every=10)

    def examples(self, split):
        return make_splits(self.cfg.arith_digits, self.cfg.arith_steps, self.cfg.arith_ops)[split]
