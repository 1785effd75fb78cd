"""A full disk, for real: every file a run writes goes to a small tmpfs that fills, and each write
path must end in one line naming the file, the reason and how to continue, with no temporary
file or half-written line left behind and nothing written before lost."""
import json
import os
import subprocess

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from plumbing import checkpoint
import tba

TOY = ["--task", "toy", "--searchers", "0", "--eval-every", "4", "--quiet"]   # + --steps
FULL = "(No space left on device)"


@pytest.fixture
def disk(tmp_path):
    """An 8 MiB file system of its own (tmpfs): when it is full the kernel says ENOSPC."""
    folder = tmp_path / "disk"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(folder)],
                             capture_output=True)
    if mounted.returncode:
        pytest.skip("needs permission to mount a small tmpfs (run as root)")
    yield folder
    subprocess.run(["umount", "-l", str(folder)], check=True)


def fill(disk, leave=0):
    """Take the disk's free space but `leave` bytes, with a file `free` removes."""
    stat = os.statvfs(disk)
    with open(disk / "filler", "ab") as f:
        f.write(b"\0" * max(stat.f_bavail * stat.f_frsize - leave, 0))


def free(disk):
    (disk / "filler").unlink()


def error_lines(capsys):
    return [line for line in capsys.readouterr().err.splitlines() if not line.startswith("note:")]


def steps_in(run_dir):
    return [json.loads(line)["step"] for line in open(run_dir / "metrics.jsonl")
            if "loss" in line]


def leftovers(run_dir):
    return sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*")
                  if ".tmp" in p.name or ".old-" in p.name)


def test_a_checkpoint_the_disk_cannot_hold_is_one_line_and_loses_nothing(disk, capsys):
    """The disk fills while checkpoint step_6 is written (its model fits, trainer.pt does not):
    one `error:` line names it, the reason and the resume command; the half-written folder is
    removed; once there is room, resuming from step_4 redoes steps 5 and 6."""
    run_dir = disk / "run"
    assert tba.main([*TOY, "--steps", "4", "--save-every", "2", "--out", str(run_dir)]) == 0
    fill(disk, leave=700_000)                 # a model (~0.4 MB) fits, with trainer.pt (~0.8) not
    capsys.readouterr()
    assert tba.main(["--resume", str(run_dir), "--steps", "8"]) == 1     # a failure, not bad input
    err = error_lines(capsys)
    assert len(err) == 1 and err[0].startswith(
        f"error: after step 6: cannot write checkpoint {run_dir / 'checkpoints' / 'step_6'} "
        f"{FULL}"), err
    assert err[0].endswith(f"continue it from step_4 with: python tba.py --resume {run_dir}")
    assert leftovers(run_dir) == [] and not (run_dir / "error.log").exists()
    assert checkpoint.latest(run_dir).name == "step_4"
    free(disk)
    assert tba.main(["--resume", str(run_dir), "--steps", "8"]) == 0
    assert steps_in(run_dir) == list(range(1, 9))
    assert [json.loads(line)["step"] for line in open(run_dir / "metrics.discarded.jsonl")] == [5, 6]


def test_config_json_on_a_full_disk_keeps_the_old_one(disk, capsys):
    run_dir = disk / "run"
    assert tba.main([*TOY, "--steps", "2", "--out", str(run_dir)]) == 0
    before = (run_dir / "config.json").read_text()
    fill(disk)
    capsys.readouterr()
    assert tba.main(["--resume", str(run_dir), "--steps", "4"]) == 1
    err = error_lines(capsys)
    assert len(err) == 1 and err[0].startswith(
        f"error: after step 2: cannot write {run_dir / 'config.json'} {FULL}"), err
    assert err[0].endswith(f"continue it from step_2 with: python tba.py --resume {run_dir}")
    assert (run_dir / "config.json").read_text() == before and leftovers(run_dir) == []


def test_lag_weights_on_a_full_disk_leave_no_temporary_file(disk, capsys):
    """--lag writes the weights of every version (~0.4 MB on the toy) into RUN/lag/."""
    run_dir = disk / "run"
    fill(disk, leave=200_000)                 # room for config.json and metrics, not the weights
    assert tba.main([*TOY, "--steps", "8", "--lag", "2", "--out", str(run_dir)]) == 1
    err = error_lines(capsys)
    assert len(err) == 1 and err[0].startswith(
        f"error: after step 0: cannot write {run_dir / 'lag' / 'version_0.pt'} {FULL}"), err
    assert err[0].endswith("no step was trained: the same command with the same --out starts it "
                           "again")
    assert leftovers(run_dir) == [] and list((run_dir / "lag").iterdir()) == []


def test_the_final_model_on_a_full_disk_names_the_system_reason(disk, tiny_model_dir):
    """safetensors reports a full disk as its own error ("... (os error 28)"): the line says what
    the system said, and the temporary folder goes."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    fill(disk, leave=100_000)                 # the configs fit, the weights (~1 MB) do not
    with pytest.raises(checkpoint.WriteError) as failed:
        checkpoint.save_pretrained(model, tokenizer, disk / "final")
    assert str(failed.value) == f"cannot write {disk / 'final'} {FULL}"
    assert sorted(p.name for p in disk.iterdir()) == ["filler"]


@pytest.mark.parametrize("name", ["metrics.jsonl", "samples.jsonl"])
def test_lines_appended_on_a_full_disk_are_all_written_or_none(disk, name):
    """metrics.jsonl and samples.jsonl grow a line at a time: a line the disk cannot hold is not
    left half written (a reader would fail on it)."""
    path = disk / name
    checkpoint.append_lines(path, ['{"step": 1}\n'])
    fill(disk, leave=8192)
    with pytest.raises(checkpoint.WriteError) as failed:
        checkpoint.append_lines(path, [json.dumps({"step": 2, "text": "x" * 20_000}) + "\n"])
    assert str(failed.value) == f"cannot write {path} {FULL}"
    assert path.read_text() == '{"step": 1}\n'


def test_a_whole_file_on_a_full_disk_keeps_the_old_one(disk):
    path = checkpoint.write_file(disk / "weights.pt", lambda f: torch.save(torch.ones(4), f))
    fill(disk)
    with pytest.raises(checkpoint.WriteError) as failed:
        checkpoint.write_file(path, lambda f: torch.save(torch.zeros(100_000), f))
    assert str(failed.value) == f"cannot write {path} {FULL}"
    assert torch.equal(torch.load(path, weights_only=True), torch.ones(4))
    assert sorted(p.name for p in disk.iterdir()) == ["filler", "weights.pt"]
