"""--report-to: TensorBoard and wandb get exactly the rows of metrics.jsonl (same keys, same
steps), the run's settings, and a resumed run reports into the same run, each step once. Offline:
TensorBoard's event files and wandb's offline run file are read back."""
import json
import shutil
import struct
import time

import pytest

from plumbing import checkpoint
import tba

TOY = ["--task", "toy", "--searchers", "0", "--eval-every", "2", "--save-every", "2", "--quiet"]


def rows(run_dir):
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


def rows_by_step(run_dir):
    """metrics.jsonl as {step: its row}, a training row and an evaluation at the same step
    merged (as wandb merges what is logged at one step)."""
    merged = {}
    for row in rows(run_dir):
        merged.setdefault(row["step"], {}).update(row)
    return merged


def crash_after_step(run_dir, stop_at):
    """The checkpoints after step `stop_at` lost, as if the run had died after writing its
    metrics up to its last step: resuming redoes the steps after `stop_at`."""
    for ckpt in checkpoint.all_checkpoints(run_dir):
        if checkpoint.step_of(ckpt) > stop_at:
            shutil.rmtree(ckpt)


def test_tensorboard_holds_every_metric_at_its_step_once_across_a_resume(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    run_dir = tmp_path / "run"
    assert tba.main([*TOY, "--steps", "6", "--report-to", "tensorboard", "--out", str(run_dir)]) == 0
    first_config = json.loads((run_dir / "config.json").read_text())
    crash_after_step(run_dir, stop_at=4)      # steps 5 and 6 are redone on resume
    assert tba.main(["--resume", str(run_dir), "--steps", "8"]) == 0
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0,
                                                                           "tensors": 0})
    events.Reload()
    expected = rows(run_dir)
    keys = {k for row in expected for k in row} - {"step"}
    assert set(events.Tags()["scalars"]) == keys
    for key in keys:
        logged = [(e.step, e.value) for e in events.Scalars(key)]
        wanted = [(row["step"], row[key]) for row in expected if key in row]
        assert [s for s, _ in logged] == [s for s, _ in wanted], key      # each step once
        if key not in ("time", "gen_tokens_per_s", "samples_per_s", "trainer_wait_s", "sync_s",
                       "search_s", "train_s", "sync_to_host_s", "sync_to_slot_s",
                       "searcher_load_s", "sync_probe_diff_max"):
            # wall-clock keys, and what the searchers loaded when, differ in the redone steps
            assert [v for _, v in logged] == pytest.approx([v for _, v in wanted], rel=1e-6), key
    config = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert json.loads(config.strip("`\n")) == first_config


WANDB_BLOCK, WANDB_HEADER = 32768, 7


def wandb_records(path):
    """The records of a wandb offline run file: a 7-byte file header, then LevelDB-style log
    records (crc32, length, type; FULL 1 or FIRST 2, MIDDLE 3, LAST 4) in 32 KiB blocks."""
    from wandb.proto import wandb_internal_pb2
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, pieces = WANDB_HEADER, b""
    while pos + WANDB_HEADER <= len(data):
        left = WANDB_BLOCK - pos % WANDB_BLOCK
        _, length, kind = struct.unpack("<IHB", data[pos:pos + WANDB_HEADER])
        if left < WANDB_HEADER or kind == 0:           # the end of a block is padding
            pos += left
            continue
        pieces += data[pos + WANDB_HEADER:pos + WANDB_HEADER + length]
        pos += WANDB_HEADER + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            pieces = b""
            yield record


def test_wandb_offline_gets_the_same_rows_and_resumes_into_the_same_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    run_dir = tmp_path / "run"
    assert tba.main([*TOY, "--steps", "6", "--report-to", "wandb", "--out", str(run_dir)]) == 0
    first_config = json.loads((run_dir / "config.json").read_text())["config"]
    crash_after_step(run_dir, stop_at=4)
    assert tba.main(["--resume", str(run_dir), "--steps", "8"]) == 0
    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    run_id = (run_dir / "wandb-id").read_text()
    assert [f.name for f in files] == [f"run-{run_id}.wandb"] * 2      # one run, two sessions
    expected = rows_by_step(run_dir)

    def read_back():
        history, configs = [], []
        for f in files:
            for record in wandb_records(f):
                kind = record.WhichOneof("record_type")
                if kind == "history":
                    items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item}
                    history.append({k: v for k, v in items.items() if not k.startswith("_")})
                elif kind == "run":
                    assert record.run.run_id == run_id
                    configs.append({u.key: json.loads(u.value_json)
                                    for u in record.run.config.update if u.key != "_wandb"})
        return history, configs
    # wandb's service process writes the offline file, and on a busy machine it may still be
    # writing the second session's last records when `finish()` has returned: wait for them
    for _ in range(50):
        history, configs = read_back()
        if len(history) >= len(expected):
            break
        time.sleep(0.2)
    assert [h["step"] for h in history] == sorted(expected)             # each step once
    for logged in history:
        assert logged.keys() == expected[logged["step"]].keys()
    assert configs[0] == first_config


def test_a_logger_that_is_not_installed_is_one_line_before_anything_loads(tmp_path, capsys,
                                                                          monkeypatch):
    import importlib.util
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real_find_spec(name, *a))
    assert tba.main([*TOY, "--report-to", "tensorboard,wandb", "--out", str(tmp_path / "r")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: --report-to wandb: the wandb package is not installed: install it with "
        "`make install-loggers`"]
    assert not (tmp_path / "r").exists()
