"""The toy task's exact distributions, the sampler against them, and real training runs."""
import json
from types import SimpleNamespace

import pytest
import torch

from llm import sampling
import tba
from tasks.toy import (EOS, LETTERS, MODES, ToyTask, all_completions, build_model, build_tokenizer,
                       exact_logprobs)


@pytest.fixture(scope="module")
def toy():
    tokenizer = build_tokenizer()
    return build_model(len(tokenizer)), tokenizer


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_enumeration_covers_every_completion(toy, temperature):
    model, tokenizer = toy
    assert len(tokenizer) == len(LETTERS) + 1      # nothing can be sampled outside the enumeration
    completions = all_completions()
    assert len(completions) == len(set(map(tuple, completions))) == 1365
    logp = exact_logprobs(model, tokenizer, "a", completions, temperature)
    assert logp.exp().sum().item() == pytest.approx(1.0, abs=1e-4)


def test_target_is_reference_tilted_by_reward(toy):
    model, tokenizer = toy
    task = ToyTask(SimpleNamespace(temperature=1.0, beta_final=0.1))
    completions = all_completions()
    target = task.target_logprobs(model, tokenizer, "d", completions)
    assert target.exp().sum().item() == pytest.approx(1.0, abs=1e-5)
    ref = exact_logprobs(model, tokenizer, "d", completions, 1.0)
    # log p* − log p_ref = r/β − log Z: two completions one reward step (0.25) apart differ by 2.5
    by_text = {" ".join(c): i for i, c in enumerate(completions)}
    mode, near = by_text["b b b b " + EOS], by_text["b b b a " + EOS]
    gap = (target[mode] - ref[mode]) - (target[near] - ref[near])
    assert gap.item() == pytest.approx(0.25 / 0.1, abs=1e-4)
    assert target.exp()[[by_text[m + " " + EOS] for m in MODES["d"]]].sum() > 0.2


def test_sampler_matches_exact_distribution(toy):
    """`sampling.generate` samples the distribution that `completion_logprobs` scores."""
    model, tokenizer = toy
    temperature, n = 0.8, 4000
    torch.manual_seed(0)
    _, _, response_ids, response_len = sampling.generate(
        model, tokenizer, [tokenizer.convert_tokens_to_ids(["a"])], num_samples=n,
        max_new_tokens=5, temperature=temperature)
    completions = all_completions()
    exact = exact_logprobs(model, tokenizer, "a", completions, temperature).exp()
    for position in range(2):         # marginals of the first two tokens, EOS-padded
        exact_marginal = torch.zeros(len(tokenizer))
        for c, p in zip(completions, exact):
            token = c[position] if position < len(c) else EOS
            exact_marginal[tokenizer.convert_tokens_to_ids(token)] += p
        counts = torch.bincount(response_ids[0, :, position], minlength=len(tokenizer)).float()
        stderr = (exact_marginal * (1 - exact_marginal) / n).sqrt()
        assert ((counts / n - exact_marginal).abs() <= 4 * stderr + 1e-3).all()
    lengths = torch.bincount(response_len[0], minlength=6).float() / n
    exact_lengths = torch.zeros(6)
    for c, p in zip(completions, exact):
        exact_lengths[len(c)] += p
    assert (lengths - exact_lengths).abs().max() < 4 * (0.25 / n) ** 0.5


def read_metrics(path):
    rows = [json.loads(line) for line in open(path)]
    return [r for r in rows if "loss" in r], [r for r in rows if "toy/tv" in r]


def test_sync_toy_run_reaches_target(tmp_path, capsys):
    """A real run of the synchronous loop: the policy's exact distribution approaches p*."""
    assert tba.main(["--task", "toy", "--searchers", "0", "--out", str(tmp_path)]) == 0
    train_rows, eval_rows = read_metrics(tmp_path / "metrics.jsonl")
    for key in ["step", "time", "samples", "loss", "log_z", "reward_mean", "kl", "beta", "lr"]:
        assert key in train_rows[-1]
    assert eval_rows[0]["step"] == 0 and eval_rows[0]["toy/tv"] > 0.5
    assert eval_rows[-1]["toy/tv"] <= 0.1
    final = [line for line in capsys.readouterr().out.splitlines() if line.startswith("final (")]
    assert len(final) == 1 and "toy/tv=" in final[0]


def test_rloo_runs(tmp_path):
    assert tba.main(["--task", "toy", "--loss", "rloo", "--searchers", "0", "--steps", "20",
                     "--eval-every", "10", "--out", str(tmp_path)]) == 0
    train_rows, eval_rows = read_metrics(tmp_path / "metrics.jsonl")
    assert len(train_rows) == 20 and [r["step"] for r in eval_rows] == [0, 10, 20]
    assert all(r["log_z"] is None for r in train_rows)   # RLOO estimates no log Z
