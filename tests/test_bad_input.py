"""Bad input and failures part-way: every bad setting is one `error:` line and exit 2 before
anything is written; a failing run (NaN, an exception) stops with exit 1 and how to continue."""
import importlib.util
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch
import torch.multiprocessing as mp

from plumbing import checkpoint
import config
from llm import models
from devices import weights
import tasks
import tba
from plumbing import schedules
import trainer
from batch import GroupBatch
from buffer import ReplayBuffer, shared_bytes

REPO = Path(__file__).resolve().parents[1]
TOY = ["--task", "toy", "--searchers", "0", "--eval-every", "4", "--quiet"]   # + --steps


def one_error_line(capsys, message):
    """stderr is exactly one line, `error: ...` holding `message`, and no traceback."""
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


@pytest.fixture(scope="module")
def toy_model_and_data(tmp_path_factory):
    """A real model folder (the toy's) and a GSM8K-format folder, so that a case can reach the
    data files and fail on them alone."""
    root = tmp_path_factory.mktemp("inputs")
    model, tokenizer = tasks.make_task(config.resolve(config.parse_args(TOY)[0])).load_model("cpu")
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    row = json.dumps({"question": "a b", "answer": "c #### 1"})
    for name, lines in {"bad_json": ([row, row, '{"question": "a",'], [row]),
                        "no_answer": ([row], [row, json.dumps({"question": "a"})])}.items():
        (root / name).mkdir()
        for split, rows in zip(("train", "test"), lines):
            (root / name / f"{split}.jsonl").write_text("\n".join(rows) + "\n")
    (root / "a_file").write_text("not a folder")
    return root


GSM8K = ["--task", "gsm8k", "--model", "INPUTS/model", "--searchers", "0",     # the toy's model:
         "--max-prompt-len", "8", "--max-new-tokens", "4"]                   # 16 positions


@pytest.mark.parametrize("args, message", [
    # unknown names and missing things
    (["--task", "chess"], "unknown task 'chess': choose one of toy, gsm8k, arith"),
    (["--task", "arith", "--model", "/no/such/model"], "model path not found: /no/such/model"),
    ([*GSM8K, "--data-dir", "/no/such/data"], "GSM8K data not found"),
    ([*GSM8K, "--data-dir", "INPUTS/bad_json"], "bad_json/train.jsonl line 3 is not valid JSON"),
    ([*GSM8K, "--data-dir", "INPUTS/no_answer"], "no_answer/test.jsonl line 2 lacks the text "
                                                  'fields "question" and "answer"'),
    (["--steps", "abc"], "argument --steps: invalid int value: 'abc'"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    # one value out of its range
    (["--steps", "0"], "--steps must be at least 1 (got 0)"),
    (["--prompts-per-step", "0"], "--prompts-per-step must be at least 1"),
    (["--group-size", "1"], "--group-size must be at least 2"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    (["--temperature", "0"], "--temperature must be greater than 0 (got 0.0)"),
    (["--beta", "-0.1"], "--beta must be at least 0.0001 and finite (got -0.1)"),   # trains away
    (["--beta", "0"], "--beta must be at least 0.0001"),                    # r/β: NaN
    (["--beta", "nan"], "--beta must be at least 0.0001 and finite (got nan)"),
    (["--beta-final", "0"], "--beta-final must be at least 0.0001"),
    (["--lr", "inf"], "--lr must be greater than 0 and at most 1 (got inf)"),
    (["--max-grad-norm", "-1"], "--max-grad-norm must be at least 0"),    # gradient ascent
    (["--micro-groups", "-1"], "--micro-groups must be at least 0"),
    (["--micro-completions", "-1"], "--micro-completions must be at least 0"),
    (["--dtype", "float8"], "--dtype must be one of auto, float32, bfloat16, float16"),
    (["--task", "arith", "--eval-batch-size", "0"], "--eval-batch-size must be at least 1"),
    (["--task", "toy", "--victim-samples", "2"], "--victim-samples is a setting of redteam, not "
     "of --task toy: drop it, or train redteam"),
    (["--eval-n", "-5"], "--eval-n must be at least 0"),
    (["--searchers", "-1"], "--searchers must be at least 0"),
    (["--recent-frac", "1.5"], "--recent-frac must be in [0, 1]"),
    (["--priority-temp", "-1"], "--priority-temp must be at least 0"),
    (["--sync-every", "0"], "--sync-every must be at least 1"),
    (["--max-reuse", "-1"], "--max-reuse must be at least 0"),
    (["--keep-checkpoints", "-1"], "--keep-checkpoints must be at least 0"),
    (["--seed", "-1"], "--seed must be in [0, 4294967295]"),
    (["--loss", "ppo"], "--loss must be one of tb, rloo, rloo-is, vcpo"),
    (["--is-clip", "0"], "--is-clip must be greater than 0 (got 0.0)"),   # no weight at all
    (["--is-clip", "-2"], "--is-clip must be greater than 0"),
    (["--lag", "-1"], "--lag must be at least 0 (got -1)"),
    (["--replay-groups", "-1"], "--replay-groups must be at least 0 (got -1)"),
    (["--search-batch", "-1"], "--search-batch must be at least 0 (got -1)"),
    (["--search-batch", "8", "--searchers", "0"], "--search-batch 8 sizes a searcher process's "
     "calls, and --searchers 0 samples each step's B groups itself"),
    (["--search-temperature", "0", "1"], "--search-temperature must be two numbers 0 < LOW <= HIGH"),
    (["--search-temperature", "2", "1"], "--search-temperature must be two numbers 0 < LOW"),
    (["--search-temperature", "1"], "argument --search-temperature: expected 2 arguments"),
    (["--search-temperature", "1", "nan"], "--search-temperature must be two numbers"),
    (["--reference-frac", "1.5"], "--reference-frac must be in [0, 1]"),
    (["--merge-cosine", "-0.1"], "--merge-cosine must be in [0, 1]"),
    (["--task", "arith", "--arith-ops", "+/"], "--arith-ops must be made of + - *"),
    (["--task", "arith", "--prompt-style", "fancy"], "--prompt-style must be one of auto, chat"),
    # combinations
    (["--task", "summarize", "--eval-samples", "0"], "--eval-samples 0: summarize evaluates on sampled"),
    (["--buffer-capacity", "200"], "--buffer-capacity 200 is below the 256 completions the "
                                    "trainer waits for"),
    (["--buffer-per-prompt", "1"], "--buffer-per-prompt must be 0 or at least 2"),
    (["--buffer-per-prompt", "32"], "--buffer-per-prompt 32 is below --group-size 64"),
    (["--buffer-evict", "newest"], "--buffer-evict must be one of oldest, lowest"),
    (["--max-staleness", "0", "--sync-every", "4"], "--max-staleness 0 is below --sync-every - 1"),
    (["--loss", "rloo"], "--loss rloo is on-policy, but --searchers 1 trains on stale"),
    (["--searchers", "64"], "--searchers 64 needs at least one CPU core each"),
    (["--loss", "rloo", "--searchers", "0", "--reference-frac", "0.2"],
     "--loss rloo is on-policy, but --search-temperature/--reference-frac sample"),
    (["--loss", "rloo", "--lag", "4"],
     "--loss rloo is on-policy, but --lag 4 trains on groups sampled 4 updates earlier"),
    (["--dedup", "--searchers", "0"], "--dedup acts on the replay buffer, and --searchers 0"),
    (["--replay-groups", "1"], "--replay-groups 1 replays in the synchronous loop, but "
                               "--searchers 1 already trains from a replay buffer"),
    (["--replay-groups", "2", "--searchers", "0"],
     "--replay-groups 2 leaves no fresh group of the --prompts-per-step 2"),
    (["--replay-groups", "1", "--searchers", "0", "--lag", "2"], "--replay-groups with --lag 2"),
    (["--loss", "rloo", "--searchers", "0", "--replay-groups", "1"],
     "--loss rloo is on-policy, but --replay-groups 1 trains on replayed groups"),
    (["--search-factor", "2", "--searchers", "0"],
     "--search-factor fills the synchronous loop's replay buffer, and --replay-groups is 0"),
    (["--seed-buffer", "4", "--searchers", "0"],
     "--seed-buffer fills the synchronous loop's replay buffer, and --replay-groups is 0"),
    (["--search-temperature-frac", "0.5"], "--search-temperature-frac 0.5 is the share of groups "
                                           "sampled at a drawn temperature"),
    (["--reward-temp", "2", "--loss", "rloo", "--searchers", "0"],
     "--reward-temp 2.0 shapes trajectory balance's target, and --loss is rloo"),
    (["--log-z", "learned", "--loss", "rloo", "--searchers", "0"],
     "--log-z learned shapes trajectory balance's target, and --loss is rloo"),
    (["--reward-temp", "0.5"], "--reward-temp must be at least 1 (got 0.5)"),
    (["--reward-temp", "2", "--reward-temp-steps", "100000"],
     "--reward-temp-steps 100000 is longer than the run's --steps"),
    (["--search-factor", "0"], "--search-factor must be at least 1 (got 0)"),
    (["--search-temperature-frac", "0"], "--search-temperature-frac must be in (0, 1] (got 0.0)"),
    (["--log-z", "head"], "--log-z must be one of group, learned"),
    (["--dedup"], "--dedup with --max-reuse 4: a buffer that stores what was found once"),
    (["--merge-cosine", "0.9", "--max-reuse", "0"], "--merge-cosine needs a task that embeds"),
    (["--lag", "2", "--searchers", "1"], "--lag 2 delays the synchronous loop's sampler, but "
                                         "--searchers 1 samples in other processes"),
    (["--ray", "local", "--searchers", "0"], "--ray local runs the searchers as Ray actors, but "
                                             "--searchers is 0"),
    (["--ray", "127.0.0.1:abc"], "--ray 127.0.0.1:abc: pass local, auto, HOST:PORT"),
    pytest.param(["--ray", "127.0.0.1:1"], "--ray 127.0.0.1:1: cannot join the Ray cluster",
                 marks=pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                                          reason="Ray is the optional --ray extra")),
    (["--report-to", "tensorboard,mlflow"], "--report-to must be tensorboard, wandb or "
                                            "tensorboard,wandb (got tensorboard,mlflow)"),
    (["--report-to", "wandb,wandb"], "--report-to must be tensorboard, wandb"),
    # the machine and the output folder
    (["--device", "cuda"], "--device cuda: this machine has no CUDA GPU"),
    (["--device", "gpu"], "--device 'gpu' is not a torch device"),
    (["--out", "INPUTS/a_file"], "a_file is a file: pass a folder"),
    (["--out", "INPUTS/a_file/run"], "a_file is a file, not a folder"),
    (["--out", "/sys/tba-run"], "--out /sys/tba-run: cannot write in /sys"),
    (["--buffer-capacity", "10000000000"], "/dev/shm has"),     # 0.8 TB of shared memory
])
def test_bad_input_is_one_line_and_exit_2(args, message, toy_model_and_data, tmp_path, capsys):
    args = [a.replace("INPUTS", str(toy_model_and_data)) for a in args]
    out = tmp_path / "run"
    if "--out" not in args:
        args += ["--out", str(out)]
    before = sorted(toy_model_and_data.rglob("*"))
    assert tba.main(args) == 2
    one_error_line(capsys, message)
    assert not out.exists()                        # nothing written for a run that never started
    assert sorted(toy_model_and_data.rglob("*")) == before


def broken_checkpoint(run):
    (checkpoint.latest(run) / "trainer.pt").write_bytes(b"\x80\x02 truncated")


def incompatible_config(run):
    record = json.loads((run / "config.json").read_text())
    record["config"]["a_setting_from_the_future"] = 1
    (run / "config.json").write_text(json.dumps(record))


def corrupt_config(run):
    (run / "config.json").write_text('{"config": {"task": "to')


def spoil_buffer(name, value):
    """A buffer.pt with the right shapes but an impossible value in its first completion."""
    def spoil(run):
        path = checkpoint.latest(run) / "buffer.pt"
        state = torch.load(path, weights_only=True)
        state[name][0] = value
        torch.save(state, path)
    return spoil


@pytest.fixture(scope="module")
def async_run(tmp_path_factory):
    """A finished 2-step run with a searcher: its checkpoint holds a buffer.pt."""
    run = tmp_path_factory.mktemp("async") / "run"
    done = subprocess.run([sys.executable, "tba.py", "--task", "toy", "--searchers", "1",
                           "--steps", "2", "--eval-every", "0", "--quiet", "--out", str(run)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return run


@pytest.mark.parametrize("kind, spoil, args, message", [
    ("sync", None, ["--resume", "MISSING"], "no such folder"),
    ("sync", corrupt_config, ["--resume", "RUN"], "config.json is corrupt"),
    ("sync", incompatible_config, ["--resume", "RUN"], "incompatible version of tba"),
    ("sync", None, ["--resume", "RUN", "--lr", "0.1"], "--lr 0.1 differs from the resumed run's 0.0005"),
    ("sync", None, ["--resume", "RUN"], "is already at step 2: pass --steps"),
    ("sync", None, ["--resume", "RUN", "--steps", "0"], "--steps must be at least 1"),
    ("sync", None, ["--resume", "RUN", "--steps", "4", "--device", "cuda"], "no CUDA GPU"),
    ("sync", broken_checkpoint, ["--resume", "RUN", "--steps", "4"], "step_2 is unreadable"),
    ("sync", None, [*TOY, "--steps", "8", "--out", "RUN"],
     "already holds a run, checkpointed at step_2: continue it with --resume"),
    ("rloo", None, ["--resume", "RUN", "--steps", "4", "--searchers", "1"], "--loss rloo is on-policy"),
    ("async", spoil_buffer("response_len", 99), ["--resume", "RUN", "--steps", "4"],
     "buffer.pt is invalid (buffer state_dict holds response lengths outside [1, 5]: [99]"),
    ("async", spoil_buffer("version", 7), ["--resume", "RUN", "--steps", "4"],
     "versions outside [-1, 2]: [7]"),
    ("async", spoil_buffer("reward", math.nan), ["--resume", "RUN", "--steps", "4"],
     "non-finite rewards"),
])
def test_bad_resume_or_output_folder(kind, spoil, args, message, async_run, tmp_path, capsys):
    run = tmp_path / "run"
    if kind == "async":
        shutil.copytree(async_run, run)
    else:
        assert tba.main([*TOY, "--steps", "2", "--out", str(run),
                         *(["--loss", "rloo"] if kind == "rloo" else [])]) == 0
    if spoil:
        spoil(run)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    args = [str(run) if a == "RUN" else str(tmp_path / "missing") if a == "MISSING" else a
            for a in args]
    capsys.readouterr()
    assert tba.main(args) == 2
    one_error_line(capsys, message)
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before   # untouched


def test_errors_have_no_traceback():
    done = subprocess.run([sys.executable, "tba.py", "--task", "toy", "--beta", "-0.1"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == "error: --beta must be at least 0.0001 and finite (got -0.1)"


def test_non_finite_step_is_never_applied(tiny_model_dir):
    """A NaN loss raises before the optimiser step: weights and optimiser state stay as they were."""
    model, _ = models.load_model(tiny_model_dir)
    optimizer, scheduler = schedules.make_optimizer(model, 1e-2, 10, 0, 0)
    before = [p.detach().clone() for p in model.parameters()]
    batch = GroupBatch(prompt_ids=torch.tensor([[1]]), prompt_mask=torch.tensor([[1]]),
                       response_ids=torch.tensor([[[2], [3]]]), response_len=torch.tensor([[1, 1]]),
                       reward=torch.tensor([[1.0, math.nan]]), ref_logp=torch.zeros(1, 2),
                       version=torch.tensor([0]), prompt_index=torch.tensor([0]))
    with pytest.raises(trainer.NonFiniteError, match="the loss is nan"):
        trainer.train_step(model, optimizer, scheduler, batch, beta=0.1)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert not optimizer.state and scheduler.last_epoch == 0


def fail_at_call(monkeypatch, n, make_loss):
    """Make the TB loss of trainer step `n` come from `make_loss(loss, log_z)`."""
    real, calls = trainer.tb_loss, []

    def loss(*args, **kwargs):
        calls.append(1)
        out = real(*args, **kwargs)
        return make_loss(*out) if len(calls) == n else out
    monkeypatch.setattr(trainer, "TB", trainer.Loss(loss))


def test_nan_loss_stops_the_run_at_that_step(tmp_path, monkeypatch, capsys):
    fail_at_call(monkeypatch, 3, lambda loss, log_z: (loss * math.nan, log_z))
    run = tmp_path / "run"
    assert tba.main([*TOY, "--steps", "8", "--save-every", "2", "--out", str(run)]) == 1
    err = capsys.readouterr().err
    assert "error: after step 2: the loss is nan and the gradient norm nan; the update was not " \
           "applied" in err
    assert f"continue it from step_2 with: python tba.py --resume {run}" in err
    assert "Traceback" not in err and not (run / "final").exists()
    assert checkpoint.latest(run).name == "step_2"
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]


@pytest.mark.parametrize("searchers", ["0", "1"])
def test_exception_mid_run_stops_searchers_and_says_how_to_continue(searchers, tmp_path,
                                                                    monkeypatch, capsys):
    def boom(loss, log_z):
        raise RuntimeError("boom")
    fail_at_call(monkeypatch, 3, boom)
    run = tmp_path / "run"
    assert tba.main(["--task", "toy", "--searchers", searchers, "--eval-every", "4", "--quiet",
                     "--steps", "8", "--save-every", "2", "--out", str(run)]) == 1
    err = capsys.readouterr().err
    assert f"error: after step 2: RuntimeError: boom (the traceback is in {run / 'error.log'})" in err
    assert f"continue it from step_2 with: python tba.py --resume {run}" in err
    assert "Traceback" not in err and "Traceback" in (run / "error.log").read_text()
    searchers_left = [c for c in psutil.Process().children(recursive=True)
                      if "spawn_main" in " ".join(c.cmdline())]
    assert not [p for p in searchers_left if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_resume_continues_the_original_schedule(tmp_path, capsys):
    """A run of 4 steps decaying to 0, extended to 6: the extension trains at the decayed rate
    (0 here) instead of rebuilding the schedule for 6 steps, where step 5 would jump back up."""
    run = tmp_path / "run"
    schedule = ["--lr", "1e-3", "--warmup-steps", "0", "--decay-steps", "4"]
    assert tba.main([*TOY, *schedule, "--steps", "4", "--out", str(run)]) == 0
    capsys.readouterr()
    assert tba.main(["--resume", str(run), "--steps", "6"]) == 0
    assert "note: the learning-rate schedule was set for 4 steps" in capsys.readouterr().err
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [r["lr"] for r in rows if "loss" in r] == pytest.approx([1e-3, 7.5e-4, 5e-4, 2.5e-4, 0, 0])


def test_shared_memory_estimate_is_what_the_buffer_and_the_weights_take(tiny_model_dir):
    """`check_shared_memory` is only as good as these two sums."""
    for dim in (0, 4):
        buffer = ReplayBuffer(7, 3, 5, 11, n_prompts=13, embedding_dim=dim)
        tensors = [getattr(buffer, name) for name in buffer.FIELDS + ("n_added",)]
        assert shared_bytes(7, 5, 11, 13, dim) == sum(t.numel() * t.element_size() for t in tensors)
    model, _ = models.load_model(tiny_model_dir)
    channel = weights.WeightChannel(model, 1, mp.get_context("spawn"))
    assert weights.WeightChannel.bytes_needed(model) == sum(
        t.numel() * t.element_size() for slot in channel.slots for t in slot.values())
    channel.close()


def test_float16_loss_scale_survives_a_resume(tmp_path):
    """--dtype float16 trains with a GradScaler, whose scale is part of the checkpoint."""
    run = tmp_path / "run"
    assert tba.main([*TOY, "--dtype", "float16", "--steps", "2", "--out", str(run)]) == 0
    saved = torch.load(run / "checkpoints" / "step_2" / "trainer.pt", weights_only=False)
    assert saved["scaler"]["scale"] > 0
    assert tba.main(["--resume", str(run), "--steps", "3"]) == 0
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [r["step"] for r in rows if "grad_scale" in r] == [1, 2, 3]


def test_missing_data_is_found_before_any_model_loads(toy_model_and_data, tmp_path, capsys,
                                                     monkeypatch):
    """A wrong --data-dir is named before the policy loads (minutes for a real model)."""
    def load_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the data files were read")
    monkeypatch.setattr(models, "load_model", load_model)
    args = [a.replace("INPUTS", str(toy_model_and_data)) for a in GSM8K]
    assert tba.main([*args, "--data-dir", "/no/such/data", "--out", str(tmp_path / "run")]) == 2
    one_error_line(capsys, "GSM8K data not found")
