"""TB for stale data (options/stale_tb.py): each loss by hand, its fixed point, exactly TB's
update at lag 0, the range of --loss, and the diagnostics a step logs."""
import copy
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import trainer
from batch import GroupBatch
from llm import logprobs, sampling
from options import losses, stale_tb
from plumbing import staleness
from tasks.toy import build_model, build_tokenizer

REPO = Path(__file__).resolve().parents[1]


def test_log_ratio_is_zero_for_completions_of_the_weights_being_trained():
    logp = torch.tensor([[-1.0, -2.0], [-3.0, -4.0]], requires_grad=True)
    behaviour = torch.tensor([[-1.5, math.nan], [-2.0, -4.5]])
    rho = staleness.log_ratio(logp, behaviour, torch.tensor([7, 5]), current=7)
    assert rho.tolist() == [[0.0, 0.0], [-1.0, 0.5]]      # group 0 fresh; a NaN log μ counts so
    rho.sum().backward()
    assert logp.grad.tolist() == [[0.0, 0.0], [1.0, 1.0]]  # the gradient flows through log π


def test_tb_trust_by_hand_and_its_fixed_point():
    """residual_i = log Ẑ + δ_i + λ·ρ_i with log Ẑ the group mean; zero exactly where
    (1+λ)·log π − λ·log μ − log p_ref − r/β is constant in the group."""
    logp = torch.tensor([[-1.0, -2.0, -4.0]])
    behaviour = torch.tensor([[-2.0, -2.0, -2.0]])
    ref, reward, beta, lam = torch.tensor([[-1.5, -1.0, -3.0]]), torch.tensor([[1.0, 0.0, 0.0]]), 0.5, 2.0
    rho = logp - behaviour                                             # [1, 3]: 1, 0, -2
    shifted = logp + lam * rho - ref - reward / beta                   # 0.5, -1, -5
    residual = shifted - shifted.mean()                                # 2.333, 0.833, -3.167
    loss, log_z = stale_tb.tb_trust_loss(logp, ref, reward, beta, rho, strength=lam)
    assert loss.item() == pytest.approx((residual ** 2).mean().item())
    assert log_z.item() == pytest.approx(-shifted.mean().item())
    # at the fixed point π ∝ (p_ref·e^{r/β})^{1/(1+λ)}·μ^{λ/(1+λ)} the loss is 0
    at_fixed = (ref + reward / beta + lam * behaviour) / (1 + lam) + 0.7
    zero, _ = stale_tb.tb_trust_loss(at_fixed, ref, reward, beta, at_fixed - behaviour, lam)
    assert zero.item() == pytest.approx(0.0, abs=1e-10)


def test_tb_topr_by_hand():
    """Squared residuals of completions pushed down (residual > 0) weighted by min(1, π/μ);
    the others, and log Ẑ, untouched."""
    logp = torch.tensor([[-1.0, -2.0, -3.0, -6.0]])
    ref, reward, beta = torch.zeros(1, 4), torch.tensor([[0.0, 0.0, 1.0, 1.0]]), 1.0
    rho = torch.tensor([[-1.0, 0.5, -3.0, -2.0]])                   # π/μ: e^-1, e^0.5, ...
    delta = logp - ref - reward / beta                                 # -1, -2, -4, -7
    residual = delta - delta.mean()                                    # 2.5, 1.5, -0.5, -3.5
    weight = torch.tensor([[math.exp(-1.0), 1.0, 1.0, 1.0]])           # min(1, e^0.5) = 1
    loss, log_z = stale_tb.tb_topr_loss(logp, ref, reward, beta, rho)
    assert loss.item() == pytest.approx((weight * residual ** 2).mean().item())
    assert log_z.item() == pytest.approx(-delta.mean().item())


def test_tb_is_by_hand():
    """Every squared residual weighted by min(1, π/μ), whichever way the step moves it."""
    logp = torch.tensor([[-1.0, -2.0, -3.0, -6.0]])
    ref, reward, beta = torch.zeros(1, 4), torch.tensor([[0.0, 0.0, 1.0, 1.0]]), 1.0
    rho = torch.tensor([[-1.0, 0.5, -3.0, -2.0]])
    residual = torch.tensor([[2.5, 1.5, -0.5, -3.5]])                  # as in tb-topr's test
    weight = torch.tensor([[math.exp(-1.0), 1.0, math.exp(-3.0), math.exp(-2.0)]])
    loss, _ = stale_tb.tb_is_loss(logp, ref, reward, beta, rho)
    assert loss.item() == pytest.approx((weight * residual ** 2).mean().item())


def test_tb_trust_gradient_is_tb_with_the_ratio_in_the_residual():
    """∂/∂log π_i of the mean squared residual: 2·(1+λ)·residual_i / K for a stale completion,
    2·residual_i / K for a fresh one (ρ = 0 and no gradient), log Ẑ held."""
    logp = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    behaviour = torch.tensor([[-1.0, -1.5, -3.5]])
    rho = staleness.log_ratio(logp, behaviour, torch.tensor([[3, 2, 2]]), current=3)
    lam = 0.5
    loss, log_z = stale_tb.tb_trust_loss(logp, torch.zeros(1, 3), torch.zeros(1, 3), 1.0, rho, lam)
    loss.backward()
    residual = log_z[:, None] + logp.detach() + lam * rho.detach()
    expected = 2 * residual / 3 * torch.tensor([[1.0, 1 + lam, 1 + lam]])
    torch.testing.assert_close(logp.grad, expected)


def sampled_batch(model, tokenizer, version):
    torch.manual_seed(1)
    ids, mask, response_ids, response_len = sampling.generate(
        model, tokenizer, [[1], [4, 2]], num_samples=6, max_new_tokens=5)
    reward = (response_len.float() / 5) + (response_ids[..., 0] == 1).float()        # [2, 6]
    batch = GroupBatch(ids, mask, response_ids, response_len, reward=reward,
                       ref_logp=torch.zeros(2, 6), version=torch.full((2,), version),
                       prompt_index=torch.arange(2))
    with torch.no_grad():
        logp = logprobs.group_logprobs(model, batch).view(2, 6)
    # log μ as generation would record it: the trainer's log π up to rounding
    batch.behaviour_logp = logp + 1e-6 * torch.randn(2, 6, generator=torch.Generator().manual_seed(0))
    return batch


def one_step(model, batch, loss, version):
    policy = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    stats = trainer.train_step(policy, optimizer, scheduler, batch, beta=0.5, loss=losses.make(loss),
                               micro_groups=1, max_grad_norm=1.0, version=version)
    return torch.cat([p.detach().flatten() for p in policy.parameters()]), stats


@pytest.mark.parametrize("loss", ["tb-trust", "tb-trust:4", "tb-topr", "tb-is", "tb-ess",
                                  "tb-topr-ess"])
def test_at_lag_zero_each_correction_takes_exactly_tbs_step(loss):
    """Groups sampled by the weights being trained (their version is the step's): the same
    weights after the step as TB's, bit for bit. Sampled by older weights: a different step."""
    tokenizer = build_tokenizer()
    model = build_model(len(tokenizer))
    fresh = sampled_batch(model, tokenizer, version=3)
    tb, tb_stats = one_step(model, fresh, "tb", version=3)
    corrected, stats = one_step(model, fresh, loss, version=3)
    assert torch.equal(tb, corrected) and stats["loss"] == tb_stats["loss"]
    if loss.endswith("-ess"):
        assert stats["lr_scale"] == 1.0
    stale = copy.copy(fresh)
    stale.behaviour_logp = fresh.behaviour_logp + torch.tensor([[1.5, -1.0, 0.5, -2.5, 2.0, -0.5]] * 2)
    tb_stale, _ = one_step(model, stale, "tb", version=19)
    corrected_stale, stats = one_step(model, stale, loss, version=19)
    assert not torch.equal(tb_stale, corrected_stale)
    if loss.endswith("-ess"):
        assert 0 < stats["lr_scale"] < 1


def test_a_step_logs_why_stale_data_hurts():
    """The diagnostics of a step on stale data, by hand where they are simple: the gradient
    cosine with the previous step (1 for the same batch twice from the same weights) and the
    mean log π/μ of the rewarded and unrewarded completions."""
    tokenizer = build_tokenizer()
    model = build_model(len(tokenizer))
    batch = sampled_batch(model, tokenizer, version=0)
    offset = torch.tensor([[1.5, -1.0, 0.5, -2.5, 2.5, -0.5]] * 2)       # π/μ = e^-offset
    batch.behaviour_logp = batch.behaviour_logp + offset
    with torch.no_grad():
        logp = logprobs.group_logprobs(model, batch).view(2, 6)
    policy = copy.deepcopy(model)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.0)      # the weights do not move
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    first = trainer.train_step(policy, optimizer, scheduler, batch, beta=0.5, version=16)
    second = trainer.train_step(policy, optimizer, scheduler, batch, beta=0.5, version=16)
    assert "grad_cos_prev" not in first and second["grad_cos_prev"] == pytest.approx(1.0, abs=1e-5)
    rho = logp - batch.behaviour_logp
    above = batch.reward > batch.reward.mean(1, keepdim=True)
    below = batch.reward < batch.reward.mean(1, keepdim=True)
    assert second["log_ratio_rewarded"] == pytest.approx(rho[above].mean().item(), rel=1e-4)
    assert second["log_ratio_unrewarded"] == pytest.approx(rho[below].mean().item(), rel=1e-4)
    assert 0 < second["low_ratio_share"] < 1         # those with π/μ = e^-2.5 carry a part


@pytest.mark.parametrize("value", ["tb-trust:0", "tb-trust:-1", "tb-trust:inf", "tb-topr:2",
                                   "tb-trust:x", "tb-nope"])
def test_a_bad_loss_is_one_error_line(value, tmp_path):
    result = subprocess.run([sys.executable, "tba.py", "--task", "toy", "--loss", value,
                             "--out", str(tmp_path / "run")], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert result.stderr.startswith(f"error: --loss must be one of tb, rloo") and value in result.stderr
    assert not (tmp_path / "run").exists()
