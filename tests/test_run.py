"""The run experience: run folder, checkpoints, resume, plots and one-line errors."""
import json
import os
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from plumbing import bookkeeping, checkpoint
import config
from plumbing import run
import tasks
import tba
import trainer

TOY = ["--task", "toy", "--searchers", "0", "--eval-every", "4", "--quiet"]   # + --steps
# Wall-clock measurements: the only metrics that may differ between two identical runs.
TIMING = {"time", "gen_tokens_per_s", "samples_per_s", "trainer_wait_s", "sync_s", "search_s",
          "train_s"}


def metrics(run):
    rows = [json.loads(line) for line in open(Path(run) / "metrics.jsonl")]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def stop_after(monkeypatch, n_steps):
    """Ctrl-C arriving during trainer step `n_steps`, through the real signal handler."""
    real_step, calls = trainer.train_step, []

    def step_then_interrupt(*args, **kwargs):
        calls.append(1)
        if len(calls) == n_steps:
            os.kill(os.getpid(), signal.SIGINT)      # Ctrl-C, as the run's handler gets it
        return real_step(*args, **kwargs)
    monkeypatch.setattr(trainer, "train_step", step_then_interrupt)


def test_run_folder_holds_everything(tmp_path):
    run = tmp_path / "run"
    assert tba.main([*TOY, "--steps", "8", "--save-every", "2", "--keep-checkpoints", "2",
                     "--out", str(run)]) == 0
    record = json.loads((run / "config.json").read_text())
    assert record["config"]["steps"] == 8 and record["config"]["lr"] == 5e-4   # resolved values
    assert record["versions"]["torch"] == torch.__version__
    assert record["layout"]["trainer"] == "cpu"
    assert [p.name for p in checkpoint.all_checkpoints(run)] == ["step_6", "step_8"]
    assert not list((run / "checkpoints").glob(".tmp-*"))
    # final/ is a plain HF folder holding the trained weights, the same as the last checkpoint.
    final = AutoModelForCausalLM.from_pretrained(run / "final")
    saved = load_file(run / "checkpoints" / "step_8" / "model" / "model.safetensors")
    for name, tensor in final.state_dict().items():
        if name in saved:
            assert torch.equal(tensor, saved[name]), name
    assert AutoTokenizer.from_pretrained(run / "final").convert_ids_to_tokens([1]) == ["a"]


def test_save_every_0_writes_the_final_model_and_no_checkpoint(tmp_path):
    """A benchmark's runs leave their trained model and metrics, not 2 GB of optimiser state each."""
    run_dir = tmp_path / "run"
    assert tba.main([*TOY, "--steps", "8", "--save-every", "0", "--out", str(run_dir)]) == 0
    assert checkpoint.latest(run_dir) is None
    assert (run_dir / "final" / "model.safetensors").is_file()
    assert [r["step"] for r in metrics(run_dir) if "loss" in r] == list(range(1, 9))


CUDA = pytest.param("cuda:0", marks=pytest.mark.gpu)       # skipped without a GPU


EXPLORE = ["--search-temperature", "0.5", "2", "--reference-frac", "0.3"]
# The synchronous loop with a replay buffer: a group of 2 replayed by reward from step 2 on.
REPLAY = ["--prompts-per-step", "3", "--replay-groups", "2", "--priority-temp", "1",
          "--buffer-evict", "lowest", "--dedup", "--max-reuse", "0"]


@pytest.mark.parametrize("device, extra", [
    ("cpu", []), ("cpu", ["--lag", "3"]), ("cpu", EXPLORE), ("cpu", REPLAY),
    pytest.param("cuda:0", [], marks=CUDA.marks)])
def test_resume_gives_the_same_run(device, extra, tmp_path, monkeypatch):
    """8 steps straight == 4 steps, Ctrl-C, resume, 4 more: same weights, same metrics. With
    --lag the old weights the sampler needs next travel in the checkpoint; with exploration,
    the random state that draws each group's temperature and sampler; with replay, the buffer
    and the random state of its draws."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    args = [*TOY, "--steps", "8", "--device", device, *extra]
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


def test_a_run_stopped_during_an_evaluation_resumes_with_it(tmp_path, monkeypatch):
    """Stopped at once (a second Ctrl-C) while step 4 is evaluated, after step 4's checkpoint:
    the resumed run evaluates step 4 before step 5, so its records and weights are those of the
    run that never stopped."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    args = [*TOY, "--steps", "8", "--save-every", "4"]
    assert tba.main([*args, "--out", str(straight)]) == 0
    real_evaluate = bookkeeping.evaluate

    def interrupted_at_step_4(*positional, step, **named):
        if step == 4:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)      # the second stops the run at once
        return real_evaluate(*positional, step=step, **named)
    with monkeypatch.context() as patch:
        patch.setattr(bookkeeping, "evaluate", interrupted_at_step_4)
        assert tba.main([*args, "--out", str(resumed)]) == 130
    assert checkpoint.latest(resumed).name == "step_4"
    assert [r["step"] for r in metrics(resumed) if "loss" not in r] == [0]   # 4's is missing
    assert tba.main(["--resume", str(resumed)]) == 0
    assert metrics(resumed) == metrics(straight)
    a = load_file(straight / "final" / "model.safetensors")
    b = load_file(resumed / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_may_switch_between_the_synchronous_loop_and_searchers(tmp_path):
    """Where the groups come from may change on resume: 2 synchronous steps, 2 with a searcher
    (an empty buffer, no sampler state yet), 2 synchronous again (no batch count to skip)."""
    run = tmp_path / "run"
    assert tba.main([*TOY, "--steps", "2", "--out", str(run)]) == 0
    assert tba.main(["--resume", str(run), "--steps", "4", "--searchers", "1"]) == 0
    assert tba.main(["--resume", str(run), "--steps", "6", "--searchers", "0"]) == 0
    rows = [r for r in metrics(run) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["buffer_completions"] > 0 for r in rows] == [False, False, True, True, False, False]


def test_a_failure_whose_traceback_cannot_be_written_is_still_one_line(tmp_path):
    """error.log goes on the same disk: when it cannot be written either, the error line says
    what failed, without pointing at a file that does not exist."""
    try:
        raise RuntimeError("boom")
    except RuntimeError as e:
        failed = run.failure(e, step=3, out=tmp_path / "no" / "such" / "folder")
        written = run.failure(e, step=3, out=tmp_path)
    assert str(failed) == "after step 3: RuntimeError: boom"
    assert str(written).endswith(f"(the traceback is in {tmp_path / 'error.log'})")
    assert "Traceback" in (tmp_path / "error.log").read_text()


def test_checkpoints_load_tensors_only(tmp_path):
    """A trainer.pt holding a pickled object (which could run code) is refused."""
    run = tmp_path / "run"
    assert tba.main([*TOY, "--steps", "2", "--out", str(run)]) == 0
    ckpt = checkpoint.latest(run)
    state = torch.load(ckpt / "trainer.pt", weights_only=True)
    state["payload"] = Path("anything")
    torch.save(state, ckpt / "trainer.pt")
    model, _ = tasks.make_task(config.resolve(config.parse_args(TOY)[0])).load_model("cpu")
    with pytest.raises(checkpoint.CheckpointError, match="unreadable"):
        checkpoint.load(ckpt, model)


def test_plot_writes_pngs(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    assert tba.main([*TOY, "--steps", "8", "--out", str(a)]) == 0
    assert tba.main([*TOY, "--steps", "8", "--out", str(b), "--loss", "rloo"]) == 0
    assert tba.main(["plot", str(a), str(b), "--out", str(tmp_path / "plots")]) == 0
    for name in ("curves_by_step.png", "curves_by_time.png"):
        png = (tmp_path / "plots" / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert tba.main(["plot", str(tmp_path / "nothing")]) == 2
    assert "has no metrics.jsonl" in capsys.readouterr().err
