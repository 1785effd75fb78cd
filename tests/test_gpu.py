"""What a researcher meets first on a GPU machine: the same assertions as the CPU tests, on CUDA.

Skipped where torch sees no CUDA GPU (this project's CI has none); `make test-gpu` runs them on a
machine that has one, and the two-GPU placement test on a machine with two or more. The
shared-prompt parity (tests/test_trainer.py) and checkpoint-and-resume (tests/test_run.py)
tests take a `cuda` case of their own, run by `make test-gpu` too.
"""
import json

import pytest
import torch

import models
import tba
from test_trainer import plain_logprobs, random_batch, tiny_llama
from trainer import group_logprobs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (run `make test-gpu` on a machine with one)")
TOY = ["--task", "toy", "--device", "cuda", "--eval-every", "100", "--quiet"]


def rows(run):
    every = [json.loads(line) for line in open(run / "metrics.jsonl")]
    return [r for r in every if "loss" in r], [r for r in every if "toy/tv" in r]


@pytest.mark.parametrize("searchers", ["0", "1"])
def test_toy_learns_on_cuda(searchers, tmp_path):
    """The synchronous loop and one searcher process, trainer on cuda: the toy reaches p*."""
    run = tmp_path / "run"
    assert tba.main([*TOY, "--searchers", searchers, "--out", str(run)]) == 0
    train_rows, eval_rows = rows(run)
    assert json.loads((run / "config.json").read_text())["layout"]["trainer"] == "cuda"
    assert eval_rows[0]["toy/tv"] > 0.5 and eval_rows[-1]["toy/tv"] <= 0.1
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in train_rows)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_searchers_take_the_other_gpus(tmp_path):
    run = tmp_path / "run"
    assert tba.main([*TOY, "--searchers", "1", "--steps", "20", "--out", str(run)]) == 0
    layout = json.loads((run / "config.json").read_text())["layout"]
    assert layout["trainer"] == "cuda" and layout["searchers"] == ["cuda:1"]


def test_bfloat16_autocast_run(tmp_path):
    """--dtype auto picks bfloat16 on a GPU that has it; the run trains and logs finite numbers."""
    if not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bfloat16")
    run = tmp_path / "run"
    assert tba.main([*TOY, "--searchers", "0", "--steps", "50", "--out", str(run)]) == 0
    assert json.loads((run / "config.json").read_text())["config"]["dtype"] == "bfloat16"
    train_rows, _ = rows(run)
    assert len(train_rows) == 50 and all(abs(r["loss"]) < float("inf") for r in train_rows)


def test_bfloat16_sampling_and_scoring_agree_on_cuda():
    """What a searcher samples under autocast is what the trainer scores under the same autocast."""
    model = tiny_llama().cuda()
    with torch.no_grad():
        model.lm_head.weight.mul_(100)
    batch = random_batch(model.config.vocab_size).to("cuda")
    with torch.no_grad(), models.autocast("cuda", torch.bfloat16):
        scored = group_logprobs(model, batch)
        again = group_logprobs(model, batch)
    reference = plain_logprobs(model, batch)                      # float32
    with torch.no_grad():
        largest_logit = model(input_ids=batch.prompt_ids).logits.abs().max()
    torch.testing.assert_close(scored, again)                     # deterministic
    # bfloat16 keeps 8 significant bits: a logit is off by up to 2^-9 of its size, a token's
    # log-prob by twice that, summed over at most 6 response tokens (tests/test_trainer.py).
    assert largest_logit > 5
    assert (scored - reference).abs().max() <= 6 * 2 * largest_logit * 2 ** -9
