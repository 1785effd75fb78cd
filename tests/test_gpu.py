"""What a researcher meets first on a GPU machine: the same assertions as the CPU tests, on CUDA.

Every test here is marked `gpu`: skipped where torch sees no CUDA GPU (this project's CI has
none), run by `make test-gpu` on a machine that has one (short runs only), the two-GPU
placement test on a machine with two or more. The shared-prompt parity (tests/test_trainer.py)
and checkpoint-and-resume (tests/test_run.py) tests take a `cuda:0` case of their own, marked
`gpu` too. Without a GPU, placement and each process's device set-up are tested through a fake
CUDA (tests/test_placement.py).
"""
import json

import pytest
import torch

from llm import logprobs
from llm import precision
from devices import placement
import tba
from tasks.toy import build_model, build_tokenizer
from test_lag import sampled
from test_trainer import plain_logprobs, random_batch, tiny_llama
from llm.logprobs import group_logprobs

pytestmark = pytest.mark.gpu
TOY = ["--task", "toy", "--eval-every", "100", "--quiet"]       # --device auto: cuda:0


def rows(run):
    every = [json.loads(line) for line in open(run / "metrics.jsonl")]
    return [r for r in every if "loss" in r], [r for r in every if "toy/tv" in r]


def loads(run):
    return [json.loads(line) for line in open(run / "weights.jsonl")]


@pytest.mark.parametrize("searchers", ["0", "1"])
def test_toy_learns_on_cuda(searchers, tmp_path):
    """The synchronous loop and one searcher process, trainer on cuda:0 (--device auto): the toy
    reaches p*. The searcher, spawned on the same GPU, loads every weight version it is sent,
    and its probe log-prob after each load is the trainer's."""
    run = tmp_path / "run"
    assert tba.main([*TOY, "--searchers", searchers, "--out", str(run)]) == 0
    train_rows, eval_rows = rows(run)
    layout = json.loads((run / "config.json").read_text())["layout"]
    assert layout["trainer"] == "cuda:0" and layout["searchers"] == ["cuda:0"] * int(searchers)
    assert eval_rows[0]["toy/tv"] > 0.5 and eval_rows[-1]["toy/tv"] <= 0.1
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in train_rows)
    if searchers == "1":
        versions = [r["loaded"] for r in loads(run)]
        assert versions[0] == 0 and versions == sorted(set(versions)) and len(versions) > 3
        assert all(r["device"] == "cuda:0" for r in loads(run))
        diffs = [r["sync_probe_diff_max"] for r in train_rows if "sync_probe_diff_max" in r]
        assert diffs and max(diffs) < 1e-3
        assert any(r.get("sync_to_host_s", 0) > 0 for r in train_rows)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_searchers_take_the_other_gpus(tmp_path):
    run = tmp_path / "run"
    assert tba.main([*TOY, "--searchers", "1", "--steps", "20", "--out", str(run)]) == 0
    layout = json.loads((run / "config.json").read_text())["layout"]
    assert layout["trainer"] == "cuda:0" and layout["searchers"] == ["cuda:1"]


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
    with torch.no_grad(), precision.autocast("cuda", torch.bfloat16):
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


@pytest.mark.parametrize("make, prompts", [("toy", [[1], [4, 2]]), ("llama", [[3, 5, 7], [4, 2]])])
def test_generate_behaviour_logprobs_are_the_trainers_under_bfloat16_autocast(make, prompts):
    """log μ recorded by `generate` (the sampling pass, with its KV cache) against the trainer's
    scoring of the same completions (the shared-prompt pass), both under bfloat16 autocast on
    the GPU with TF32 on, as a searcher and the trainer run them: equal up to bfloat16's
    rounding of the logits (2^-9 of the largest, twice per token log-prob), over 5 tokens."""
    placement.set_up_process("cuda:0", 1)
    tokenizer = build_tokenizer()
    model = (build_model(len(tokenizer)) if make == "toy" else tiny_llama()).cuda()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20)            # logits far from uniform
    with precision.autocast("cuda:0", torch.bfloat16):
        response_ids, behaviour_logp, logp = sampled(model, tokenizer, prompts, temperature=0.7)
        largest_logit = model(input_ids=response_ids.flatten(0, 1)).logits.abs().max().item()
    assert behaviour_logp.device.type == "cuda" and behaviour_logp.shape == (2, 6)
    assert (behaviour_logp - logp).abs().max() <= 5 * 2 * (largest_logit / 0.7) * 2 ** -9 + 1e-4


def test_check_logprobs_passes_with_tf32_on():
    """`check_logprobs` runs after the process's set-up has switched TF32 matmuls on."""
    placement.set_up_process("cuda:0", 1)
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    logprobs.check_logprobs(tiny_llama().cuda())


def test_the_summaries_kl_is_measured_on_the_gpu(tiny_model_dir):
    """The evaluation's KL batch built on the GPU, every tensor where its ids are: the policy as
    its own reference gives 0 (tests/test_summarize.py checks the devices on the CPU)."""
    import config
    from tasks import make_task
    summarize = make_task(config.resolve(config.parse_args(
        ["--task", "summarize", "--model", str(tiny_model_dir), "--max-new-tokens", "4"])[0]))
    model, tokenizer = summarize.load_model("cuda:0")
    prompts = summarize.prompts("test", tokenizer)[:2]
    assert summarize.summarize(model, tokenizer, prompts, greedy=False, n=2, ref_model=model)[2] == 0
