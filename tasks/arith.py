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


class ArithTask(AnswerTask):
    name = "arith"
    # Chosen for SmolLM2-135M-Instruct on a 2-core CPU (greedy accuracy on held-out problems):
    # - Asked to reason step by step (the GSM8K instruction, 128 new tokens) it starts at 25%
    #   and did not improve in 20 steps (25%, 25%, 20%): a step took ~50 s, too few updates.
    # - Asked for the number only, with 32 new tokens, it starts at 37% (21% of samples right at
    #   temperature 0.7, 11% at 1.0) and a step takes ~20 s. It first learns which operation a
    #   word means ("sells" is -), reaching 83% after 20-35 steps, but at lr 3e-5 further steps
    #   erode its sums (8 + 6 = 10) and it fell back to 52% by step 40 or 70. So at first: 25
    #   steps, the last 10 decaying: 37% -> 75% in 11 minutes (the last point says what replaced it).
    # - β 0.05 (r/β = 20 for a right answer) left the end fragile with one searcher: 0.638 ±
    #   0.068 over seeds 0-2, seed 0 falling from 69% to 56%. β 0.2 ended higher on each of the
    #   same seeds (README, arith).
    # - Training each group once (max_reuse 1) instead of up to 4 times closed the one-searcher
    #   gap at β 0.05: 0.820 ± 0.081 against synchronous TB's 0.833 ± 0.209 and 0.638 ± 0.068
    #   with reuse 4, at the same staleness (~2 steps) and wall time (RESULTS.md, staleness).
    # - micro_groups 1: one group a backward pass takes the trainer's peak from 5.0 to 3.8 GiB
    #   in the same time (0.99× within a ±14% spread; bench/README.md, memory).
    # - 100 steps at lr 1e-5 (TBA's GSM8K rate), not 25 at 3e-5: over 100 synchronous steps
    #   lr 3e-5 collapsed the samples onto one answer per problem (mean log π of a sample -0.6,
    #   most groups of equal rewards) and fell 13-20 points from its best (final 0.789 ± 0.088,
    #   2 seeds); lr 1e-5 did not collapse, learned faster by step 10 (0.644 ± 0.024 against
    #   0.434) and ended at 0.923 ± 0.036 over 5 seeds (RESULTS.md, learning that lasts).
    # - β 0.05, not 0.2, for those 100 steps: TB's β divides the reward and meets the whole
    #   sequence's log π/p_ref, so β 0.2 held the policy far nearer the reference than GRPO's
    #   β 0.2. At β 0.05 (bfloat16, 5 seeds) the samples collapse onto right answers, the target
    #   p_ref·e^{20r}: 0.677 by step 10 (0.644 at β 0.2), final 0.966 ± 0.027 (0.923 ± 0.036),
    #   largest falls 2.3-6.2 points (4.7-8.6); RESULTS.md, round 13. The 25-step one-searcher
    #   runs above were at lr 3e-5.
    instruction = "Reply with only the final number."
    defaults = dict(AnswerTask.defaults, arith_digits=1, arith_steps=1, arith_ops="+-",
                    steps=100, prompts_per_step=4, group_size=8, max_new_tokens=32,
                    temperature=0.7, beta=0.05, beta_final=0.05, beta_steps=0, lr=1e-5,
                    warmup_steps=5, decay_steps=10, eval_every=10, eval_n=128,
                    sync_every=2, recent_frac=0.95, min_buffer=4, buffer_capacity=4000,
                    max_reuse=1, micro_groups=1, save_every=10)

    def examples(self, split):
        return make_splits(self.cfg.arith_digits, self.cfg.arith_steps, self.cfg.arith_ops)[split]
