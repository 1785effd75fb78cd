"""What a researcher meets first on a GPU machine: the same assertions as the CPU tests, on CUDA.

Skipped where torch sees no CUDA GPU (this project's CI has none); `make test-gpu` runs them on a
machine that has one, and the two-GPU placement test on a machine with two or more.
"""
import json

import pytest
import torch
from safetensors.torch import load_file

import checkpoint
import models
import tba
from test_run import metrics, stop_after
from test_trainer import plain_logprobs, random_batch, tiny_llama
from trainer import enable_activation_checkpointing, group_logprobs, tb_loss

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


@pytest.mark.parametrize("checkpointing", [False, True])
def test_shared_prompt_logprobs_and_gradients_on_cuda(checkpointing):
    """tests/test_trainer.py's parity of the shared-prompt path with full sequences, on the GPU.
    Tolerance: TF32 matmuls (10-bit mantissa, `models.use_device`) are off here, so float32."""
    model = tiny_llama().cuda()
    if checkpointing:
        enable_activation_checkpointing(model)
    batch = random_batch(model.config.vocab_size).to("cuda")
    params = list(model.parameters())
    flat = lambda grads: torch.cat([g.flatten() for g in grads])
    shared = group_logprobs(model, batch, temperature=0.8).view(3, 4)
    reference = plain_logprobs(model, batch, temperature=0.8).view(3, 4)
    torch.testing.assert_close(shared, reference, rtol=1e-4, atol=1e-4)
    tb = lambda logp: tb_loss(logp, batch.ref_logp, batch.reward, beta=0.5)[0]
    torch.testing.assert_close(flat(torch.autograd.grad(tb(shared), params)),
                               flat(torch.autograd.grad(tb(reference), params)),
                               rtol=1e-3, atol=1e-5)


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


def test_checkpoint_and_resume_on_cuda(tmp_path, monkeypatch):
    """8 steps straight == 4 steps, Ctrl-C, resume, 4 more: the same weights and metrics on the
    GPU as on the CPU (tests/test_run.py)."""
    args = [*TOY, "--searchers", "0", "--steps", "8", "--eval-every", "4"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert tba.main([*args, "--out", str(straight)]) == 0
    with monkeypatch.context() as patch:
        stop_after(patch, 4)
        assert tba.main([*args, "--out", str(resumed)]) == 130
    assert checkpoint.latest(resumed).name == "step_4"
    assert tba.main(["--resume", str(resumed)]) == 0
    assert metrics(resumed) == metrics(straight)
    a = load_file(straight / "final" / "model.safetensors")
    b = load_file(resumed / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
