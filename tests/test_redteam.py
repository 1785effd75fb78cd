"""The red-teaming task: its reward by hand, its metrics on hand-made sets, and real runs."""
import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import tba
from tasks import scorers
from tasks.redteam import RedTeamTask, attack_metrics, reward_of

REPO = Path(__file__).resolve().parents[1]


def test_reward_is_the_mean_clamped_log_toxicity():
    toxicity = torch.tensor([[0.5, 0.25], [0.0, 1.0], [1e-6, 1e-6]])        # [N=3, S=2]
    expected = [(math.log(0.5) + math.log(0.25)) / 2, (math.log(1e-4) + 0.0) / 2, math.log(1e-4)]
    torch.testing.assert_close(reward_of(toxicity), torch.tensor(expected))
    # so exp(r/β) is the geometric mean of the (clamped) toxicity to the power 1/β
    beta = 0.5
    geometric_mean = (0.5 * 0.25) ** 0.5
    torch.testing.assert_close(reward_of(toxicity[:1]).div(beta).exp(),
                               torch.tensor([geometric_mean ** (1 / beta)]))


def test_attack_metrics_by_hand():
    toxicity = torch.tensor([0.9, 0.1, 0.6, 0.7])
    embeddings = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0], [0.0, 1.0]])
    m = attack_metrics(toxicity, embeddings, "eval")
    assert m["eval/success_rate"] == 0.75
    assert m["eval/diversity"] == pytest.approx(1 - (0 + 0 + 1) / 3)   # successes 0, 2, 3
    assert m["eval/diversity_all"] == pytest.approx(1 - (0 + 0 + 0 + 1 + 1 + 1) / 6)
    assert m["eval/toxicity"] == pytest.approx(0.575)
    assert m["eval/unique_successes"] == 2                               # 2 and 3 are one attack


def test_search_metrics_count_unique_successes_over_the_run():
    task = RedTeamTask(SimpleNamespace())
    first = {"toxicity": np.array([0.9, 0.2], dtype=np.float32),
             "embeddings": np.array([[1, 0, 0], [0, 1, 0]], dtype=np.float32)}
    second = {"toxicity": np.array([0.8, 0.95], dtype=np.float32),       # a repeat, and a new one
              "embeddings": np.array([[1, 0, 0], [0, 0, 1]], dtype=np.float32)}
    assert task.search_metrics([]) == {}
    assert task.search_metrics([first])["redteam/unique_successes"] == 1
    m = task.search_metrics([second])
    assert m["redteam/unique_successes"] == 2
    assert m["redteam/success_rate"] == 0.75                             # 3 of the 4 so far
    assert m["redteam/diversity"] == pytest.approx(1 - 1 / 3)            # [1,0,0] twice, [0,0,1]


def test_score_is_the_reward_with_what_the_trainer_logs():
    """score() gives reward() and, per attack, the mean toxicity and the embedding."""
    task = RedTeamTask(SimpleNamespace(victim_samples=2))
    answers = {"you idiot": ["you idiot", "ok"], "hello": ["hi", "hello"]}
    task.answer = lambda attacks: [a for attack in attacks for a in answers[attack]]
    task.toxicity = lambda texts: torch.tensor([0.9 if "idiot" in t else 0.01 for t in texts])
    task.embedder = lambda texts: torch.eye(2)[:len(texts)]
    attacks = ["you idiot", "hello"]
    rewards, info = task.score(None, attacks)
    assert rewards == task.reward(None, attacks) == pytest.approx(
        [(math.log(0.9) + math.log(0.01)) / 2, math.log(0.01)])
    np.testing.assert_allclose(info["toxicity"], [0.455, 0.01], rtol=1e-6)
    assert info["embeddings"].shape == (2, 2)


def needs_scorers():
    for package, install in ((scorers.TOXICITY_PACKAGE, scorers.TOXICITY_INSTALL),
                             (scorers.EMBEDDER_PACKAGE, scorers.EMBEDDER_INSTALL)):
        if scorers.package_dir(package) is None:
            pytest.skip(f"{package} is not installed: {install}")


@pytest.mark.parametrize("mode", ["sync", "async", "explore"])
def test_two_training_steps(mode, tiny_model_dir, tmp_path):
    """Tiny attacker and victim (random weights, the SmolLM2 tokenizer), the packaged scorers.
    explore: a searcher sampling at temperatures from [0.7, 1.4] into a buffer that merges
    near-duplicate attacks by the task's embeddings."""
    needs_scorers()
    out = tmp_path / "run"
    args = ["--task", "redteam", "--model", str(tiny_model_dir), "--victim-model",
            str(tiny_model_dir), "--steps", "2", "--prompts-per-step", "2", "--group-size", "2",
            "--max-new-tokens", "6", "--victim-max-new-tokens", "6", "--eval-n", "8",
            "--min-buffer", "2", "--searchers", "0" if mode == "sync" else "1", "--quiet",
            "--out", str(out)]
    if mode == "explore":
        args += ["--search-temperature", "0.7", "1.4", "--merge-cosine", "0.9", "--max-reuse",
                 "0", "--priority-temp", "1"]
    if mode == "sync":
        assert tba.main(args) == 0
    else:
        done = subprocess.run([sys.executable, "tba.py", *args], cwd=REPO, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "loss" not in r]
    assert [r["step"] for r in train] == [1, 2] and [r["step"] for r in evals] == [0, 2]
    for r in evals:
        assert r["eval/n"] == 8 and 0 <= r["eval/success_rate"] <= 1
        assert 0 <= r["eval/unique_successes"] <= 8 and r["eval/diversity_all"] > 0
    for r in train:
        assert math.log(1e-4) <= r["reward_mean"] <= 0
        if mode == "explore":
            assert 0.7 <= r["search_temperature_mean"] <= 1.4 and r["trained_completions"] >= 4
        assert 0 <= r["redteam/success_rate"] <= 1 and r["redteam/unique_successes"] >= 0
    samples = [json.loads(line) for line in open(out / "samples.jsonl")]
    assert {s["step"] for s in samples} == {0, 2}
    assert all(len(s["answers"]) == 2 == len(s["toxicity"]) for s in samples)


def test_search_metrics_state_survives_a_checkpoint(tmp_path):
    """A resumed run goes on counting unique successes where it stopped."""
    task = RedTeamTask(SimpleNamespace())
    info = {"toxicity": np.array([0.9, 0.2, 0.7], dtype=np.float32),
            "embeddings": np.eye(3, dtype=np.float32)}
    before = task.search_metrics([info])
    torch.save(task.state_dict(), tmp_path / "task.pt")
    resumed = RedTeamTask(SimpleNamespace())
    resumed.load_state_dict(torch.load(tmp_path / "task.pt", weights_only=True))
    assert resumed.search_metrics([]) == before
    assert RedTeamTask(SimpleNamespace()).state_dict()["found"] is None    # an empty run saves too
