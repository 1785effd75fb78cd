"""The summarisation task: loaders, both reward paths, win rate and KL, and short runs."""
import json
import time

import pytest
import torch
from transformers import LlamaConfig, LlamaForSequenceClassification

import config
from llm import models
import tba
from plumbing import bookkeeping
from plumbing.run import MetricsLog
from tasks import make_task
from tasks.summarize import (RewardModel, SimilarityReward, detokenize, read_aclsum, read_jsonl,
                             win_rate)

POST = ("My landlord said he would fix the heating in October, it is now January and my flat "
        "is 12 degrees. He does not answer calls any more.\nTL;DR:")


def task(*args):
    cfg = config.parse_args(["--task", "summarize", *args])[0]
    return make_task(config.resolve(cfg))


def test_similarity_reward_orders_summaries():
    """A faithful summary beats another post's summary, which beats nothing; copying a text
    twice the reference's length costs the length term."""
    reward = SimilarityReward(torch.device("cpu"))
    reference = "The landlord has not fixed the heating for three months and ignores calls."
    candidates = ["My landlord still has not repaired the heating and won't answer my calls.",
                  "I adopted a kitten and she keeps knocking my plants over.",
                  ""]
    scores = reward([POST] * 3, candidates, [reference] * 3)
    assert scores.shape == (3,)
    assert scores[0] > 0.5 > scores[1] > scores[2] == -1.0
    copy = " ".join([candidates[0]] * 3)               # 3× the words: penalty (3·13/13 − 1)/2 = 1
    assert reward([POST], [copy], [reference])[0] < scores[0] - 0.9


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory, tiny_model_dir):
    """A randomly initialised one-output sequence classifier with the SmolLM2 tokenizer."""
    _, tokenizer = models.load_model(tiny_model_dir)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         num_labels=1, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("reward-model")
    LlamaForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_reward_model_scores_in_batches_as_one_by_one(reward_model_dir):
    reward = RewardModel(str(reward_model_dir), torch.device("cpu"), batch_size=3)
    summaries = ["Heating broken.", "The landlord ignores me about the heating, for months.",
                 "x", "Cold flat; landlord silent since October.", "", "A kitten."]
    together = reward([POST] * 6, summaries)
    alone = torch.cat([reward([POST], [s]) for s in summaries])
    assert together.shape == (6,) and together.dtype == torch.float32
    torch.testing.assert_close(together, alone, rtol=1e-4, atol=1e-5)   # padding is masked
    assert together.unique().numel() == 6
    assert next(reward.model.parameters()).device.type == "cpu" and not reward.model.training


def test_reward_model_needs_one_output(tmp_path, reward_model_dir):
    config = LlamaConfig.from_pretrained(reward_model_dir)
    config.num_labels = 2
    LlamaForSequenceClassification(config).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((reward_model_dir / name).read_bytes())
    with pytest.raises(ValueError, match="has 2 outputs; a reward model has one"):
        RewardModel(str(tmp_path), torch.device("cpu"))


def test_win_rate_by_hand():
    ours, theirs = torch.tensor([1.0, 0.2, 0.5, -3.0]), torch.tensor([0.5, 0.7, 0.5, -4.0])
    assert win_rate(ours, theirs).tolist() == [1.0, 0.0, 0.5, 1.0]     # a tie counts half


def test_kl_is_zero_for_the_reference_and_positive_away_from_it(tiny_model_dir):
    summarize = task("--model", str(tiny_model_dir), "--max-new-tokens", "6")
    model, tokenizer = summarize.load_model("cpu")
    prompts = summarize.prompts("test", tokenizer)[:8]
    sampled, length, kl = summarize.summarize(model, tokenizer, prompts, greedy=False, n=2,
                                              ref_model=model)
    assert kl == 0.0 and len(sampled) == 16 and all(isinstance(t, str) for t in sampled)
    assert 1 <= length <= 6
    moved = models.load_model(tiny_model_dir)[0]
    with torch.no_grad():
        moved.lm_head.weight.mul_(30)                  # a much sharper policy than the reference
    torch.manual_seed(0)
    assert summarize.summarize(moved, tokenizer, prompts, False, 2, ref_model=model)[2] > 1.0


def test_evaluation_draws_the_same_dice_every_time_and_leaves_training_rng_alone(tiny_model_dir):
    summarize = task("--model", str(tiny_model_dir), "--max-new-tokens", "6")
    model, tokenizer = summarize.load_model("cpu")
    prompts = summarize.prompts("test", tokenizer)[:4]
    torch.manual_seed(123)
    first = summarize.sample(model, tokenizer, prompts, 2)[0]
    after_first = torch.rand(1)
    torch.manual_seed(123)
    second = summarize.sample(model, tokenizer, prompts, 2)[0]
    assert first == second and torch.equal(torch.rand(1), after_first)


def test_loaders(tmp_path):
    assert detokenize(["In", "this", "paper", ",", "we", "(", "QA", ")", "win", "."]) == \
        "In this paper, we (QA) win."
    train, test = read_aclsum("train"), read_aclsum("test")
    assert len(train) == 100 and len(test) == 100
    abstract, summary = test[0]
    assert " ," not in abstract and len(summary.split()) > 30
    # the hub formats: trl-lib/tldr (prompt, completion) and CarperAI (prompt, label)
    rows = [{"prompt": POST, "completion": " Heating broken."}, {"prompt": POST, "label": "Cold."}]
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert read_jsonl(path) == [(POST, " Heating broken."), (POST, "Cold.")]
    path.write_text(json.dumps(rows[0]) + "\n" + json.dumps({"prompt": POST}) + "\n")
    with pytest.raises(ValueError, match=r"train.jsonl line 2 needs a text field .* and a summary"):
        read_jsonl(path)


@pytest.mark.parametrize("searchers", ["0", "1"])
def test_short_runs(searchers, tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    assert tba.main(["--task", "summarize", "--model", str(tiny_model_dir), "--steps", "2",
                     "--max-new-tokens", "6", "--eval-n", "4", "--searchers", searchers,
                     "--quiet", "--out", str(run)]) == 0
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    evals = [r for r in rows if "eval/win_rate" in r]
    assert [r["step"] for r in evals] == [0, 2]
    # at step 0 the policy is the reference and, on the same dice, writes the baseline itself
    assert evals[0]["eval/win_rate"] == evals[0]["eval/greedy_win_rate"] == 0.5
    assert evals[0]["eval/kl"] == 0.0
    assert {"eval/reward_mean", "eval/greedy_reward_mean", "eval/length", "eval/n"} <= set(evals[-1])
    assert -1.0 <= evals[-1]["eval/reward_mean"] <= 1.0                # a cosine, less a penalty
    samples = [json.loads(line) for line in open(run / "samples.jsonl")]
    assert {"summary", "greedy", "reference", "reward", "win"} <= set(samples[0])


def test_evaluation_scores_as_training_does_under_bfloat16(reward_model_dir, tiny_model_dir,
                                                          tmp_path):
    """A bfloat16 run's settings (autocast on): the reward evaluation logs for each summary is
    the reward model's as `score` calls it in training, outside any autocast (a searcher scores
    after its autocast block): the scorer measures what training optimises, in its own float32.
    Under the trainer's autocast it would score in bfloat16, a few hundredths away."""
    summarize = task("--model", str(tiny_model_dir), "--reward-model", str(reward_model_dir),
                     "--dtype", "bfloat16", "--max-new-tokens", "6", "--eval-n", "3",
                     "--eval-samples", "1", "--out", str(tmp_path))
    policy, tokenizer = summarize.load_model("cpu")
    ref_model = models.frozen_copy(policy, torch.bfloat16)
    bookkeeping.evaluate(summarize, policy, tokenizer, ref_model, step=1, start=time.time(),
                         log=MetricsLog(tmp_path / "metrics.jsonl"))
    samples = [json.loads(line) for line in open(tmp_path / "samples.jsonl")]
    prompts = summarize.prompts("test", tokenizer)[:3]
    assert len(samples) == 3
    texts = [summarize.examples("test")[p.index][0] for p in prompts]
    as_trained = summarize.reward_model(texts, [s["summary"] for s in samples],
                                        [s["reference"] for s in samples])          # [3]
    torch.testing.assert_close(torch.tensor([s["reward"] for s in samples]), as_trained,
                               rtol=0, atol=1e-6)
    assert not any(p.requires_grad for p in summarize.reward_model.model.parameters())
