"""Every precision a run may meet, on the CPU: each loss in float32, bfloat16 and float16 (with a
real GradScaler, so the scaled gradient is what the step sees), with log Z estimated or learned;
a learned log Z's float16 step against its float32 step; evaluation at training's precision."""
import json
import math

import pytest
import torch

import tba
from options.learned_log_z import LearnedLogZ
from plumbing.schedules import make_optimizer
from test_bad_input import one_error_line
from test_trainer import random_batch, tiny_llama
from trainer import sequence_logprobs, tb_loss, train_step

LOSSES = ["tb", "rloo", "rloo-is", "vcpo"]
DTYPES = ["float32", "bfloat16", "float16"]


@pytest.mark.parametrize("log_z", ["group", "learned"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("loss", LOSSES)
def test_every_loss_trains_in_every_precision_or_is_refused(loss, dtype, log_z, tmp_path, capsys):
    """24 combinations: 2 steps of the toy with a finite loss (and, for tb, a finite log Z), or
    one `error:` line where the combination means nothing (a log Z is trajectory balance's)."""
    run = tmp_path / "run"
    args = ["--task", "toy", "--searchers", "0", "--steps", "2", "--group-size", "8",
            "--eval-every", "0", "--quiet", "--loss", loss, "--dtype", dtype, "--log-z", log_z,
            "--out", str(run)]
    if loss != "tb" and log_z == "learned":
        assert tba.main(args) == 2
        one_error_line(capsys, "--log-z learned shapes trajectory balance's target")
        assert not run.exists()
        return
    assert tba.main(args) == 0
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for row in steps:          # float16: an overflowing step is skipped by the scaler (inf norm)
        assert math.isfinite(row["loss"])
        assert math.isfinite(row["grad_norm"]) or dtype == "float16"
        assert (row["log_z"] is None) == (loss != "tb")
        assert row["log_z"] is None or math.isfinite(row["log_z"])
        assert ("grad_scale" in row) == (dtype == "float16")     # the scaler runs on the CPU too
    assert json.loads((run / "config.json").read_text())["config"]["dtype"] == dtype


def log_z_after_two_steps(dtype, scaler=None):
    """A tiny Llama's learned log Z after two steps on one batch: the first sets each prompt's
    entry to its group estimate, the second starts from the estimate + offsets and, at
    lr = B/2, lands back on the estimate. -> (log Z, the estimate)"""
    batch = random_batch(24)                              # 3 prompts, K = 4
    model, table = tiny_llama(), LearnedLogZ(3, lr=1.5)
    optimizer, scheduler = make_optimizer(model, lr=0.0, total_steps=2, warmup_steps=0,
                                          decay_steps=0)
    step = dict(beta=0.5, dtype=dtype, scaler=scaler, learned_log_z=table)
    train_step(model, optimizer, scheduler, batch, **step)
    estimate = table.values.detach().clone()
    table.values.data = estimate + torch.tensor([1.0, -2.0, 0.5])
    train_step(model, optimizer, scheduler, batch, **step)
    return table.values.detach(), estimate


def test_a_float16_step_moves_a_learned_log_z_as_far_as_a_float32_step():
    """GradScaler multiplies the loss by its scale (here 2^8), so log Z's gradient carries that
    factor: the step divides it out, and log Z lands where float32 lands (the estimate, within
    float16's error), not 256 times as far."""
    exact, estimate = log_z_after_two_steps(torch.float32)
    torch.testing.assert_close(exact, estimate, atol=1e-4, rtol=0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)     # no overflow on this model
    half, half_estimate = log_z_after_two_steps(torch.float16, scaler)
    assert scaler.get_scale() == 2.0 ** 8                         # neither step was skipped
    torch.testing.assert_close(half, half_estimate, atol=1e-3, rtol=0)
    torch.testing.assert_close(half, exact, atol=0.05, rtol=0)


def test_an_overflowing_float16_step_leaves_a_learned_log_z_where_it_was():
    """A loss scale so large that the float16 backward overflows: the scaler skips the policy's
    step and lowers the scale, and log Z's step is skipped with it (not taken on an inf or a
    scaled gradient)."""
    batch = random_batch(24)
    model, table = tiny_llama(), LearnedLogZ(3, lr=1.5)
    optimizer, scheduler = make_optimizer(model, lr=1e-3, total_steps=2, warmup_steps=0,
                                          decay_steps=0)
    with torch.no_grad():
        logp = sequence_logprobs(model, batch).view(3, 4)
    _, estimate = tb_loss(logp, batch.ref_logp, batch.reward, beta=0.5)
    table.values.data = estimate + torch.tensor([1.0, -2.0, 0.5])
    before = [p.detach().clone() for p in model.parameters()]
    scaler = torch.amp.GradScaler("cpu", init_scale=1e30)
    stats = train_step(model, optimizer, scheduler, batch, beta=0.5, dtype=torch.float16,
                       scaler=scaler, learned_log_z=table)
    assert not math.isfinite(stats["grad_norm"]) and scaler.get_scale() < 1e30   # skipped
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    torch.testing.assert_close(table.values.detach(), estimate + torch.tensor([1.0, -2.0, 0.5]))
    assert table.values.grad is None
