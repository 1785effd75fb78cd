"""The run experience: run folder, checkpoints, resume, plots and one-line errors."""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import checkpoint
import tba
import trainer

TOY = ["--task", "toy", "--searchers", "0", "--steps", "8", "--eval-every", "4", "--quiet"]
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
            tba.request_stop(None, None)
        return real_step(*args, **kwargs)
    monkeypatch.setattr(trainer, "train_step", step_then_interrupt)


def test_run_folder_holds_everything(tmp_path):
    run = tmp_path / "run"
    assert tba.main([*TOY, "--save-every", "2", "--keep-checkpoints", "2", "--out", str(run)]) == 0
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


def test_resume_gives_the_same_run(tmp_path, monkeypatch):
    """8 steps straight == 4 steps, Ctrl-C, resume, 4 more: same weights, same metrics."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert tba.main([*TOY, "--out", str(straight)]) == 0
    with monkeypatch.context() as patch:
        stop_after(patch, 4)
        assert tba.main([*TOY, "--out", str(resumed)]) == 130
    assert checkpoint.latest(resumed).name == "step_4"
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
    assert [r["buffer_groups"] > 0 for r in rows] == [False, False, True, True, False, False]


def test_interrupted_checkpoint_write_leaves_the_previous_one(tmp_path, monkeypatch):
    run = tmp_path / "run"
    assert tba.main([*TOY, "--steps", "4", "--save-every", "2", "--out", str(run)]) == 0
    real_save = torch.save

    def crash_while_writing(obj, path, *args, **kwargs):
        if ".tmp-step_6" in str(path):
            raise OSError("No space left on device")
        return real_save(obj, path, *args, **kwargs)
    with monkeypatch.context() as patch:
        patch.setattr(checkpoint.torch, "save", crash_while_writing)
        assert tba.main(["--resume", str(run), "--steps", "8"]) == 1     # a failure, not bad input
    assert "No space left on device" in (run / "error.log").read_text()
    assert (run / "checkpoints" / ".tmp-step_6" / "model").is_dir()      # the half-written one
    assert checkpoint.latest(run).name == "step_4"
    # Steps 5 and 6 were logged before the crash; resuming from step 4 redoes them.
    assert tba.main(["--resume", str(run), "--steps", "8"]) == 0
    assert [r["step"] for r in metrics(run) if "loss" in r] == list(range(1, 9))
    assert [json.loads(line)["step"] for line in open(run / "metrics.discarded.jsonl")] == [5, 6]
    assert not list((run / "checkpoints").glob(".tmp-*"))


def test_checkpoints_load_tensors_only(tmp_path):
    """A trainer.pt holding a pickled object (which could run code) is refused."""
    run = tmp_path / "run"
    assert tba.main([*TOY, "--steps", "2", "--out", str(run)]) == 0
    ckpt = checkpoint.latest(run)
    state = torch.load(ckpt / "trainer.pt", weights_only=True)
    state["payload"] = Path("anything")
    torch.save(state, ckpt / "trainer.pt")
    model, _ = tba.tasks.make_task(tba.resolve(tba.parse_args(TOY)[0])).load_model("cpu")
    with pytest.raises(checkpoint.CheckpointError, match="unreadable"):
        checkpoint.load(ckpt, model)


def test_plot_writes_pngs(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    assert tba.main([*TOY, "--out", str(a)]) == 0
    assert tba.main([*TOY, "--out", str(b), "--loss", "rloo"]) == 0
    assert tba.main(["plot", str(a), str(b), "--out", str(tmp_path / "plots")]) == 0
    for name in ("curves_by_step.png", "curves_by_time.png"):
        png = (tmp_path / "plots" / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert tba.main(["plot", str(tmp_path / "nothing")]) == 2
    assert "has no metrics.jsonl" in capsys.readouterr().err
