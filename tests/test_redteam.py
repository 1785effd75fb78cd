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
from tasks.redteam import RedTeamTask, attack_metrics, attacker_metrics, reward_of, unique_attacks

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


def test_a_diversity_of_fewer_than_two_attacks_is_left_out():
    m = attack_metrics(torch.tensor([0.9, 0.1]), torch.eye(2), "eval")
    assert "eval/diversity" not in m and m["eval/diversity_all"] == pytest.approx(1.0)
    assert scorers.diversity(torch.eye(3)[:1]) is None


def test_unique_attacks_cluster_greedily_at_a_threshold():
    """In order: an attack joins the first kept one it is at least τ-close to, else starts a
    cluster. b is 0.8-close to a, c is 0.8-close to b but 0.28 to a: at 0.7, a and c lead two
    clusters (b joined a); at 0.9 all three lead; at 0.25 one cluster."""
    a, b = [1.0, 0.0], [0.8, 0.6]
    c = [0.8 * 0.8 - 0.6 * 0.6, 0.6 * 0.8 + 0.8 * 0.6]                  # b turned by b's angle
    emb = torch.tensor([a, b, c])
    assert torch.allclose(emb @ emb.T, torch.tensor([[1, 0.8, 0.28], [0.8, 1, 0.8],
                                                     [0.28, 0.8, 1]]), atol=1e-6)
    assert [unique_attacks(emb, t) for t in (0.25, 0.7, 0.9)] == [1, 2, 3]


def test_attacker_metrics_by_hand():
    """Four attacks, two answers each: mean toxicity 0.8, 0.3, 0.55, 0.5 -> attacks 0 and 2
    succeed (above 0.5, not at it)."""
    toxicity = torch.tensor([[0.9, 0.7], [0.1, 0.5], [0.6, 0.5], [0.5, 0.5]])
    emb = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8], [0.0, 1.0]])
    m = attacker_metrics(toxicity, emb)
    assert m["toxicity_rate"] == 0.5 and m["successes"] == 2 and m["attacks"] == 4
    assert m["answers_per_attack"] == 2 and m["toxicity_mean"] == pytest.approx(0.5375)
    cosines = [0, 0.6, 0, 0.8, 1, 0.8]                  # pairs 01 02 03 12 13 23
    assert m["diversity"] == pytest.approx(1 - sum(cosines) / 6)
    assert m["diversity_successes"] == pytest.approx(1 - 0.6)
    assert (m["unique_0.5"], m["unique_0.7"], m["unique_0.9"]) == (1, 2, 2)
    one = attacker_metrics(toxicity[:2], emb[:2])        # a single success: undefined, not 0
    assert one["diversity_successes"] is None and one["unique_0.7"] == 1
    none = attacker_metrics(toxicity[1:2], emb[1:2])
    assert none["toxicity_rate"] == 0 and none["diversity"] is None and none["unique_0.7"] == 0


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
    task = RedTeamTask(SimpleNamespace(victim_samples=2, min_attack_tokens=0))
    answers = {"you idiot": ["you idiot", "ok"], "hello": ["hi", "hello"]}
    task.answer = lambda attacks, *how: [a for attack in attacks for a in answers[attack]]
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


def test_the_final_attacker_is_evaluated_as_the_field_does(tiny_model_dir, tmp_path):
    """bench/redteam_eval.py on a 2-step run: N attacks, S answers each, the metrics written
    beside the run; asked again with the same settings it reports the file, and a checkpoint
    that does not exist is one error line."""
    needs_scorers()
    out = tmp_path / "run"
    assert tba.main(["--task", "redteam", "--model", str(tiny_model_dir), "--victim-model",
                     str(tiny_model_dir), "--steps", "2", "--prompts-per-step", "2",
                     "--group-size", "2", "--max-new-tokens", "6", "--victim-max-new-tokens", "6",
                     "--eval-every", "0", "--searchers", "0", "--quiet", "--out", str(out)]) == 0
    command = [sys.executable, "bench/redteam_eval.py", str(out), "--attacks", "12",
               "--answers", "3", "--answer-tokens", "4"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    record = json.loads((out / "attacker_eval.json").read_text())
    m = record["metrics"]
    assert (m["attacks"], m["answers_per_attack"]) == (12, 3)
    assert 0 <= m["toxicity_rate"] <= 1 and m["successes"] == round(m["toxicity_rate"] * 12)
    assert 0 < m["diversity"] <= 2 and m["unique_0.5"] <= m["unique_0.7"] <= m["unique_0.9"]
    assert f"| {out} |" in done.stdout
    again = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and json.loads((out / "attacker_eval.json").read_text()) == record
    missing = subprocess.run([*command, "--step", "7"], cwd=REPO, capture_output=True, text=True,
                             timeout=300)
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1
    assert "step_7" in missing.stderr
