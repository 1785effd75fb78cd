"""Staleness, measured and controlled: behaviour log-probs, --lag, importance weights and ESS."""
import copy
import math

import pytest
import torch

from llm import logprobs
from llm import sampling
from options import losses, rloo
import searcher
from engines import sources
import tasks
import trainer
from plumbing import staleness
from batch import GroupBatch
from config import resolve, settings
from options.policy_lag import Lag
from test_trainer import tiny_llama
from tasks.toy import build_model, build_tokenizer


def sampled(model, tokenizer, prompts, k=6, temperature=1.0):
    """Generation's own behaviour log-probs, and the trainer's for the same completions."""
    torch.manual_seed(1)
    ids, mask, response_ids, response_len, behaviour_logp = sampling.generate(
        model, tokenizer, prompts, num_samples=k, max_new_tokens=5, temperature=temperature,
        with_logprobs=True)
    zeros = torch.zeros(len(prompts), k, device=ids.device)
    batch = GroupBatch(ids, mask, response_ids, response_len, reward=zeros, ref_logp=zeros,
                       version=torch.zeros(len(prompts), dtype=torch.long, device=ids.device),
                       prompt_index=torch.arange(len(prompts), device=ids.device))
    with torch.no_grad():
        logp = logprobs.group_logprobs(model, batch, temperature).view(len(prompts), k)
    return response_ids, behaviour_logp, logp


@pytest.mark.parametrize("make, prompts", [("toy", [[1], [4, 2]]), ("llama", [[3, 5, 7], [4, 2]])])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behaviour_logprobs_equal_the_trainers_when_nothing_is_stale(make, prompts, temperature):
    """log μ recorded while sampling == log π the trainer computes for the same weights and
    completions (float32; 1e-5 on sums of 5 token log-probs: the cached decoding and the
    trainer's shared-prompt pass add in different orders). Recording draws nothing: same
    tokens as without it."""
    tokenizer = build_tokenizer()
    model = build_model(len(tokenizer)) if make == "toy" else tiny_llama()
    response_ids, behaviour_logp, logp = sampled(model, tokenizer, prompts,
                                                 temperature=temperature)
    assert behaviour_logp.shape == (2, 6)
    assert torch.allclose(behaviour_logp, logp, atol=1e-5)
    torch.manual_seed(1)
    _, _, plain_ids, _ = sampling.generate(model, tokenizer, prompts, num_samples=6,
                                           max_new_tokens=5, temperature=temperature)
    assert torch.equal(plain_ids, response_ids)


def test_truncated_is_weights_by_hand():
    logp = torch.tensor([[-1.0, -2.0, -3.0]])
    behaviour_logp = torch.tensor([[-1.0, -3.0, -2.0]])       # ratios 1, e, 1/e
    w = rloo.truncated_is_weights(logp, behaviour_logp, clip=2.0)
    assert torch.allclose(w, torch.tensor([[1.0, 2.0, math.exp(-1)]]))
    w = rloo.truncated_is_weights(logp, behaviour_logp, clip=8.0)
    assert torch.allclose(w, torch.tensor([[1.0, math.e, math.exp(-1)]]))
    with pytest.raises(ValueError, match="need the behaviour log-probs"):
        rloo.truncated_is_weights(logp, None, clip=2.0)
    with pytest.raises(ValueError, match="need the behaviour log-probs"):
        rloo.truncated_is_weights(logp, torch.full((1, 3), math.nan), clip=2.0)


def test_rloo_with_is_weights_by_hand():
    """loss = −mean(w · A · log π), A the leave-one-out advantage of r − β(log π − log p_ref),
    w held constant: its gradient with respect to log π is −w·A/N."""
    logp = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    ref_logp = torch.zeros(1, 3)
    reward = torch.tensor([[1.0, 0.0, 0.0]])
    beta, w = 0.5, torch.tensor([[2.0, 1.0, 0.5]])
    kl_reward = torch.tensor([[1.5, 1.0, 1.5]])               # r − 0.5·log π
    advantage = kl_reward - torch.tensor([[1.25, 1.5, 1.25]])  # minus the mean of the others
    loss = rloo.rloo_loss(logp, ref_logp, reward, beta, is_weight=w)
    assert loss.item() == pytest.approx(-(w * advantage * logp.detach()).mean().item())
    loss.backward()
    assert torch.allclose(logp.grad, -(w * advantage) / 3)
    # unit weights are plain RLOO
    plain = rloo.rloo_loss(logp.detach(), ref_logp, reward, beta)
    ones = rloo.rloo_loss(logp.detach(), ref_logp, reward, beta, is_weight=torch.ones(1, 3))
    assert plain.item() == ones.item()


def test_ess_and_log_ratio_by_hand():
    logp = torch.tensor([[0.0, 0.0], [0.0, 0.0]])
    behaviour_logp = torch.tensor([[0.0, 0.0], [0.0, -math.log(3)]])   # weights 1, 1, 1, 3
    m = staleness.off_policy_metrics(logp, behaviour_logp)
    assert m["log_ratio_mean"] == pytest.approx(math.log(3) / 4)
    assert m["ess_frac"] == pytest.approx(6 ** 2 / 12 / 4)             # (Σw)²/Σw² = 3 of 4
    on_policy = staleness.off_policy_metrics(logp, logp)
    assert on_policy == {"log_ratio_mean": 0.0, "ess_frac": pytest.approx(1.0)}
    # completions without a recorded μ are left out; huge ratios do not overflow
    unknown = torch.tensor([[math.nan, 0.0], [0.0, -1000.0]])
    m = staleness.off_policy_metrics(logp, unknown)
    assert m["ess_frac"] == pytest.approx(1 / 3)


def test_vcpo_takes_the_rloo_is_step_times_root_ess():
    """--loss vcpo: the loss and gradient of rloo-is, and an optimiser step at the learning
    rate times √(ESS/N), ESS of the untruncated weights π/μ; the schedule's rate is kept for
    the next step. Behaviour log-probs set to log π + known offsets make the weights known:
    w = 1, 1, …, e^-2, e^2 (the last truncated to 2 in the loss, not in ESS)."""
    tokenizer = build_tokenizer()
    model = build_model(len(tokenizer))
    torch.manual_seed(1)
    ids, mask, response_ids, response_len = sampling.generate(
        model, tokenizer, [[1], [4, 2]], num_samples=6, max_new_tokens=5)
    reward = (response_len.float() / 5) + (response_ids[..., 0] == 1).float()        # [2, 6]
    batch = GroupBatch(ids, mask, response_ids, response_len, reward=reward,
                       ref_logp=torch.zeros(2, 6), version=torch.zeros(2, dtype=torch.long),
                       prompt_index=torch.arange(2))
    with torch.no_grad():
        logp = logprobs.group_logprobs(model, batch).view(2, 6)                        # [2, 6]
    offset = torch.zeros(2, 6)
    offset[1, 4], offset[1, 5] = 2.0, -2.0                   # w = π/μ = e^-2 and e^2
    batch.behaviour_logp = logp + offset
    w = (-offset).exp().flatten()                                                    # [12]
    ess_frac = (w.sum() ** 2 / (w ** 2).sum() / 12).item()    # 0.396
    start = torch.cat([p.flatten() for p in model.parameters()])
    steps, stats = {}, {}
    for loss, lr in (("vcpo", 0.1), ("rloo-is", 0.1 * math.sqrt(ess_frac))):
        policy = copy.deepcopy(model)
        # plain SGD, so parameters move by exactly lr · gradient
        optimizer = torch.optim.SGD(policy.parameters(), lr=lr)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        stats[loss] = trainer.train_step(policy, optimizer, scheduler, batch, beta=0.5,
                                         loss=losses.make(loss, 2.0), micro_groups=1)
        steps[loss] = torch.cat([p.flatten() for p in policy.parameters()]) - start
        assert optimizer.param_groups[0]["lr"] == lr            # the schedule's rate, kept
    assert stats["vcpo"]["ess_frac"] == pytest.approx(ess_frac, rel=1e-4)
    assert stats["vcpo"]["lr_scale"] == pytest.approx(math.sqrt(ess_frac), rel=1e-4)
    assert "lr_scale" not in stats["rloo-is"]
    # the loss by hand: −mean over groups of Σ_k w_k·A_k·log π_k / K, w truncated at 2
    is_weight = (-offset).exp().clamp(max=2.0)
    expected = rloo.rloo_loss(logp, batch.ref_logp, reward, 0.5, is_weight=is_weight)
    assert stats["vcpo"]["loss"] == pytest.approx(expected.item(), rel=1e-4)
    assert stats["vcpo"]["loss"] == pytest.approx(stats["rloo-is"]["loss"], rel=1e-6)
    assert steps["vcpo"].abs().max() > 1e-4
    torch.testing.assert_close(steps["vcpo"], steps["rloo-is"], rtol=1e-4, atol=1e-8)
    # on-policy data (ESS/N = 1) takes the full step
    assert staleness.ess_step_scale(staleness.off_policy_metrics(logp, logp)) == pytest.approx(1.0)
    assert staleness.ess_step_scale({}) == 1.0


def lagged_source(lag, out):
    """An SynchronousSource source of the toy task with --lag `lag`, and the policy it lags behind. In
    float32, not --dtype auto: the tests compare with their own float32 forward passes, and auto
    picks bfloat16 autocast on a CPU with native bfloat16 (log-probs then differ by ~1e-3)."""
    cfg = resolve(settings(task="toy", searchers=0, lag=lag, prompts_per_step=2, group_size=8,
                           dtype="float32", out=str(out)))
    task = tasks.make_task(cfg)
    policy, tokenizer = task.load_model(torch.device("cpu"))
    ref_model = copy.deepcopy(policy).requires_grad_(False)
    source = sources.SynchronousSource(cfg, task, policy, ref_model, tokenizer,
                               task.prompts("train", tokenizer),
                               lag=Lag(lag, policy, out) if lag else None)
    return cfg, source, policy


@pytest.mark.parametrize("lag", [0, 3])
def test_lag_samples_with_the_weights_exactly_lag_updates_old(lag, tmp_path):
    """Each step's groups come from version max(v − L, 0): its stamp says so, and its behaviour
    log-probs are that version's log-probs (computed here from a copy the test kept), not those
    of the versions beside it. L = 0 samples with the policy itself. Only the L + 1 newest
    versions stay on disk, and those a checkpoint on disk samples with next."""
    cfg, source, policy = lagged_source(lag, tmp_path)
    kept, pinned = [], None                          # the test's own copy of every version
    for version in range(7):
        kept.append(copy.deepcopy(policy))
        batch, _ = source.next_batch(version)
        want = max(version - lag, 0)
        assert batch.version.tolist() == [[want] * batch.version.shape[1]] * 2
        with torch.no_grad():
            errors = [(logprobs.group_logprobs(m, batch, cfg.temperature).view(2, -1)
                       - batch.behaviour_logp).abs().max().item() for m in kept]
        assert errors[want] < 1e-5
        assert all(e > 1e-3 for i, e in enumerate(errors) if i != want), errors
        on_disk = sorted(int(f.stem[8:]) for f in (tmp_path / "lag").glob("version_*.pt"))
        keep_from = want if pinned is None else min(want, pinned)
        assert on_disk == (list(range(keep_from, version + 1)) if lag else [])
        if version == 4:                  # a checkpoint after step 5: its next steps need
            (tmp_path / "checkpoints" / "step_5").mkdir(parents=True)   # versions 5 − L on
            pinned = max(5 - lag, 0)
        with torch.no_grad():                        # "an update": every weight moves
            for p in policy.parameters():
                p.add_(0.05 * torch.randn_like(p))
    assert (source.lag is None) == (lag == 0)


def test_lag_zero_is_the_synchronous_loop_bit_for_bit(tmp_path):
    """--lag 0 samples what `searcher.sample_groups` gives on the policy itself, from the same
    random state: same tokens, same behaviour log-probs."""
    cfg, source, policy = lagged_source(0, tmp_path)
    torch.manual_seed(5)
    batch, _ = source.next_batch(0)
    prompts = next(tasks.prompt_batches(source.task.prompts("train", source.tokenizer),
                                        cfg.prompts_per_step, cfg.seed))
    torch.manual_seed(5)
    direct, _ = searcher.sample_groups(policy, source.ref_model, source.tokenizer, source.task,
                                       prompts, group_size=cfg.group_size,
                                       max_new_tokens=cfg.max_new_tokens,
                                       temperature=cfg.temperature)
    for name in ("response_ids", "response_len", "reward", "ref_logp", "behaviour_logp"):
        assert torch.equal(getattr(batch, name), getattr(direct, name)), name


def test_every_run_says_how_off_policy_its_data_was(tmp_path):
    """A searcher's groups carry the log μ of the weights that sampled them through the shared
    buffer; each step logs mean log π/μ and ESS/N (on-policy: 0 and 1)."""
    import json
    import tba
    for name, flags in (("sync", ["--searchers", "0"]), ("async", ["--searchers", "1"]),
                        ("lag", ["--lag", "4", "--loss", "rloo-is"])):
        out = tmp_path / name
        assert tba.main(["--task", "toy", "--steps", "8", "--save-every", "0", "--quiet",
                         "--eval-every", "0", *flags, "--out", str(out)]) == 0
        rows = [r for r in map(json.loads, open(out / "metrics.jsonl")) if "loss" in r]
        assert all(0 < r["ess_frac"] <= 1 + 1e-6 and math.isfinite(r["log_ratio_mean"])
                   for r in rows)
        if name == "sync":
            assert all(abs(r["log_ratio_mean"]) < 1e-5 and r["ess_frac"] > 1 - 1e-5
                       for r in rows)
        if name == "lag":
            assert [r["staleness_mean"] for r in rows] == [0, 1, 2, 3, 4, 4, 4, 4]
            assert all(r["ess_frac"] < 1 - 1e-4 for r in rows[1:])


def test_a_lagged_run_resumes_only_with_its_old_weights(tmp_path, capsys):
    """The checkpoint's next steps sample with versions kept in RUN/lag/; if they are gone,
    the resume is refused in one line before anything is written."""
    import tba
    out = tmp_path / "run"
    assert tba.main(["--task", "toy", "--lag", "3", "--steps", "4", "--save-every", "2",
                     "--quiet", "--out", str(out)]) == 0
    on_disk = sorted(f.name for f in (out / "lag").iterdir())
    assert on_disk[-3:] == ["version_1.pt", "version_2.pt", "version_3.pt"]  # for steps 5, 6, 7
    (out / "lag" / "version_1.pt").unlink()
    capsys.readouterr()
    assert tba.main(["--resume", str(out), "--steps", "6"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "lacks the weights of version 1 that --lag 3 samples" in err


def test_a_lagged_run_resumes_from_an_older_kept_checkpoint(tmp_path):
    """Every kept checkpoint keeps the weight files its next steps need: with the newest one
    deleted (the advice for a damaged checkpoint), the run resumes from the one before and
    samples with the same old weights as a run that never stopped."""
    import json
    import shutil
    import tba
    flags = ["--task", "toy", "--lag", "3", "--save-every", "2", "--eval-every", "0", "--quiet"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert tba.main([*flags, "--steps", "8", "--out", str(straight)]) == 0
    assert tba.main([*flags, "--steps", "8", "--out", str(resumed)]) == 0
    shutil.rmtree(resumed / "checkpoints" / "step_8")       # back to step 6
    assert tba.main(["--resume", str(resumed), "--steps", "8"]) == 0

    def losses(run):
        rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
        return {r["step"]: r["loss"] for r in rows if "loss" in r}
    assert losses(resumed)[7] == losses(straight)[7] and losses(resumed)[8] == losses(straight)[8]


def test_uncorrected_rloo_is_tb_at_any_lag():
    """Neither loss looks at μ, so on groups sampled by *another* policy too (here the
    reference, far from the trained policy) ∇ RLOO = (β/2)·K/(K−1)·∇ TB, exactly: at one β,
    uncorrected RLOO and TB take the same direction at every lag, and only the importance
    weights of rloo-is make a different off-policy baseline."""
    from test_trainer import sampled_batch
    torch.manual_seed(0)                 # the same policy and samples whatever ran before
    tokenizer = build_tokenizer()
    reference = build_model(len(tokenizer))
    policy = copy.deepcopy(reference)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    beta, k = 0.3, 6
    batch = sampled_batch(reference, tokenizer, reference, k=k)      # stale: the old policy's
    params = list(policy.parameters())
    grads = {}
    for name, loss_fn in (("tb", trainer.tb_loss), ("rloo", rloo.rloo_loss)):
        logp = logprobs.group_logprobs(policy, batch).view(2, k)
        out = loss_fn(logp, batch.ref_logp, batch.reward, beta)
        loss = out[0] if isinstance(out, tuple) else out
        grads[name] = torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)])
    assert grads["tb"].norm() > 1e-3
    torch.testing.assert_close(grads["rloo"], (beta / 2) * k / (k - 1) * grads["tb"],
                               rtol=1e-4, atol=1e-7)
