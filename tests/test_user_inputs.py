"""The inputs users really give, as a table: each case a command, the exit code, the one line
it must print (a fragment) and the files that must come out of it unchanged. Most run with
--dry-run, in this process, in under a second."""
import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

import config
import tba
from plumbing import checkpoint, flags, plot, run
from plumbing.errors import NonFiniteError, diverged_policy_named

REPO = Path(__file__).resolve().parents[1]
TOY = ["--task", "toy", "--searchers", "0", "--eval-every", "0", "--quiet"]


def a_run_record(folder, task="toy"):
    """config.json as tba writes it (the settings of a toy run), and nothing else."""
    cfg = config.resolve(config.parse_args(["--task", "toy"])[0], measure=False)
    settings = {**json.loads(json.dumps(cfg.__dict__, default=str)), "task": task}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"config": settings}))


def metrics(folder, *rows):
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


EVAL_ROW, STEP_ROW = {"step": 0, "toy/tv": 0.9}, {"step": 1, "loss": 2.0}


def users_folder(out):                                  # --out on a folder of one's own
    (out / "data").mkdir(parents=True)
    (out / "thesis.txt").write_text("three years")
    (out / "final").mkdir()
    (out / "final" / "notes.txt").write_text("do not lose")


def hf_model_folder(out):                               # a model given as --out
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 8}))


def trained_without_checkpoint(out):
    a_run_record(out)
    metrics(out, EVAL_ROW, STEP_ROW, {"step": 2, "loss": 1.0})


def failed_start_and_a_note(out):
    a_run_record(out)
    metrics(out, EVAL_ROW)
    (out / "notes.txt").write_text("mine")


def run_of_a_lost_task(out):                            # trained with --task mytasks:Sorting
    a_run_record(out, task="no_such_module_here:Sorting")
    (out / "checkpoints" / "step_2").mkdir(parents=True)


def empty_metrics(out):
    a_run_record(out)
    metrics(out)


def module(name, text):
    """A module of your own, on sys.path for the case (the test's monkeypatch removes it)."""
    def make(out):
        out.mkdir()
        (out / f"{name}.py").write_text(text)
    return make


MODULES = "OUT"                 # cases whose modules lie in OUT put it on sys.path

CASES = [
    # (what the user did, set-up of OUT, the command, exit code, the line's fragment)
    ("--out on a folder of their own", users_folder, [*TOY, "--out", "OUT"], 2,
     "is a folder that tba did not write (it holds data/, final/, thesis.txt)"),
    ("an HF model folder as --out", hf_model_folder, [*TOY, "--out", "OUT"], 2,
     "is a folder that tba did not write (it holds config.json)"),
    ("an HF model folder as --resume", hf_model_folder, ["--resume", "OUT"], 2,
     "is not a run folder (its config.json is not a run's; a model folder?)"),
    ("--out on a run that trained and wrote no checkpoint", trained_without_checkpoint,
     [*TOY, "--out", "OUT"], 2, "holds a run that trained 2 steps and wrote no checkpoint, so it "
                                "cannot be resumed: pass another --out, or delete"),
    ("--resume on it", trained_without_checkpoint, ["--resume", "OUT"], 2,
     "has no checkpoint to resume from (it stopped before its first one): start it again, with "
     "--out OUT if it trained no step, else with another --out"),
    ("--out on a failed start holding a file of theirs", failed_start_and_a_note,
     [*TOY, "--out", "OUT"], 2, "stopped before its first step and files that tba did not "
                                "write (notes.txt): move those"),
    ("resume a run whose task's module is gone", run_of_a_lost_task, ["--resume", "OUT"], 2,
     "was trained on a task that cannot be loaded here: --task no_such_module_here:Sorting: "
     "cannot import no_such_module_here"),
    # --task module:Name
    ("a module with a syntax error", module("broken_task", "def f(:\n"),
     ["--task", "broken_task:Sorting"], 2, "importing broken_task failed (SyntaxError"),
    ("a module that raises", module("raising_task", "raise RuntimeError('no GPU')\n"),
     ["--task", "raising_task:Sorting"], 2, "importing raising_task failed (RuntimeError: no GPU)"),
    ("a class that is not a Task", module("plain_task", "class Sorting:\n    pass\n"),
     ["--task", "plain_task:Sorting"], 2, "plain_task.Sorting is not a Task subclass"),
    ("a class that is not there", module("plain_task2", "x = 1\n"),
     ["--task", "plain_task2:Sorting"], 2, "plain_task2 has no Sorting: check the class name"),
    ("a module that is not there", None, ["--task", "nowhere_task:Sorting"], 2,
     "cannot import nowhere_task (No module named 'nowhere_task'): run from the folder that "
     "holds it, or add that folder to PYTHONPATH"),
    ("a stray colon", None, ["--task", "tasks.toy:ToyTask:x"], 2,
     "name your own task as module:Class"),
    # lengths against the model's context, read before it loads
    ("--max-new-tokens past the toy's context", None, ["--task", "toy", "--max-new-tokens", "40"],
     2, "the prompt + --max-new-tokens 40 tokens exceed the policy's context of 16: lower "
        "--max-new-tokens to 15 or less"),
    ("--max-new-tokens past a model's context", None,
     ["--task", "arith", "--model", "MODEL", "--max-new-tokens", "600"], 2,
     "--max-prompt-len 512 + --max-new-tokens 600 tokens exceed the policy's context of 1024"),
    # settings that act only with another: one rule for all
    ("--model for the toy", None, ["--task", "toy", "--model", "/no/such/model"], 2,
     "--model acts on the policy it loads, and this task builds its own model: drop it"),
    ("--sync-every without searchers", None, [*TOY, "--sync-every", "4"], 2,
     "--sync-every acts on the searchers, and --searchers is 0"),
    ("--max-staleness without a buffer", None, [*TOY, "--max-staleness", "3"], 2,
     "--max-staleness acts on a replay buffer, and --searchers 0 has none"),
    ("--priority-temp without a buffer", None, [*TOY, "--priority-temp", "1"], 2,
     "--priority-temp acts on a replay buffer"),
    ("--log-z-lr without a learned log Z", None, ["--task", "toy", "--log-z-lr", "0.1"], 2,
     "--log-z-lr acts on a learned log Z, and --log-z is group: add --log-z learned"),
    ("--lora-alpha without --lora-rank", None, ["--task", "arith", "--lora-alpha", "8"], 2,
     "--lora-alpha acts on a LoRA adapter, and --lora-rank is 0: add --lora-rank R"),
    ("a flag given twice", None, ["--task", "toy", "--steps", "3", "--steps=4"], 2,
     "--steps is given twice: keep one"),
    # values that cannot train
    ("a learning rate of 5", None, ["--task", "toy", "--lr", "5"], 2,
     "--lr must be greater than 0 and at most 1 (got 5.0)"),
    ("β of 1e-6", None, ["--task", "toy", "--beta", "1e-6"], 2,
     "--beta must be at least 0.0001 and finite (got 1e-06)"),
    # plot
    ("plot a run with no rows", empty_metrics, ["plot", "OUT"], 2, "has no rows yet"),
    ("plot into a file", trained_without_checkpoint, ["plot", "OUT", "--out", "OUT/config.json"],
     2, "--out OUT/config.json: cannot write there"),
]


@pytest.mark.parametrize("what, set_up, argv, code, fragment", CASES,
                         ids=[c[0] for c in CASES])
def test_what_users_give(what, set_up, argv, code, fragment, tmp_path, tiny_model_dir,
                         monkeypatch, capsys):
    out = tmp_path / "out"
    if set_up:
        set_up(out)
    monkeypatch.syspath_prepend(str(out))               # the cases' own modules
    argv = [str(out) if a == "OUT" else a.replace("OUT/", f"{out}/")
            .replace("MODEL", str(tiny_model_dir)) for a in argv]
    if argv[0] != "plot":
        argv += ["--dry-run"]
    before = {p: p.read_bytes() if p.is_file() else None for p in tmp_path.rglob("*")}
    capsys.readouterr()
    assert tba.main(argv) == code
    err = capsys.readouterr().err.strip().splitlines()
    fragment = fragment.replace("OUT", str(out))
    assert len(err) == 1 and err[0].startswith("error: ") and fragment in err[0], err
    after = {p: p.read_bytes() if p.is_file() else None for p in tmp_path.rglob("*")
             if "__pycache__" not in p.parts}
    assert after == {p: v for p, v in before.items() if "__pycache__" not in p.parts}


def test_a_failed_start_is_replaced_by_the_next_one(tmp_path, capsys):
    """A start that trained no step (its config.json and an evaluation row) is the project's:
    the same --out starts again there, and the old rows are gone."""
    out = tmp_path / "run"
    a_run_record(out)
    metrics(out, {"step": 0, "toy/tv": 0.123456})
    (out / "error.log").write_text("Traceback ...")
    assert run.failed_start(out)
    assert tba.main([*TOY, "--steps", "1", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 1] and rows[0]["toy/tv"] != 0.123456
    assert not (out / "error.log").exists()
    assert tba.main([*TOY, "--steps", "1", "--out", str(out), "--dry-run"]) == 2   # now a run
    assert "already holds a run, checkpointed at step_1" in capsys.readouterr().err


@pytest.mark.parametrize("recipe", sorted((REPO / "recipes").glob("*.toml")),
                         ids=lambda p: p.stem)
def test_a_recipe_copied_with_steps_3_resolves_as_the_command_line_does(recipe, tmp_path):
    """`steps = 3` in a copy of a recipe fits its schedule as `--config FILE --steps 3` does:
    the same settings, except where the copy's schedule no longer says which run it was made
    for (then it is fitted to the shortest run it fits)."""
    copy = tmp_path / recipe.name
    copy.write_text(re.sub(r"(?m)^steps = \d+", "steps = 3", recipe.read_text()))

    def resolved(*argv):
        cfg, _, actions = config.parse_args([*argv, "--out", str(tmp_path / "run")])
        return config.resolve(cfg, recipe=actions["recipe"], measure=False,
                              recipe_steps=actions["recipe_steps"])
    ours = resolved("--config", str(copy))
    theirs = resolved("--config", str(recipe), "--steps", "3")
    assert ours.warmup_steps + ours.decay_steps <= 3 and ours.beta_steps <= 3
    differ = {k for k in ours.__dict__ if getattr(ours, k) != getattr(theirs, k)}
    assert differ <= set(flags.SCHEDULE)
    if recipe.stem not in ("paper-tldr", "redteam-gpu"):   # schedules made for their steps
        assert not differ


def test_a_second_ctrl_c_during_a_checkpoint_leaves_no_temporary_folder(tmp_path):
    class Interrupted(torch.nn.Linear):
        def save_pretrained(self, folder):
            raise KeyboardInterrupt

    model = Interrupted(2, 2)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(tmp_path, 3, model, None, {"source": {}})
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save_pretrained(model, None, tmp_path / "final")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["checkpoints"]


def test_a_diverged_policy_is_named_when_sampling_fails_on_it():
    probabilities = torch.tensor([[float("nan"), 1.0]])          # what a NaN weight gives
    with pytest.raises(NonFiniteError, match="version 7: the policy has diverged"):
        with diverged_policy_named(7):
            torch.multinomial(probabilities, 1)
    with pytest.raises(RuntimeError, match="other"):             # other errors pass through
        with diverged_policy_named(7):
            raise RuntimeError("other")


def test_the_interrupt_line_names_the_checkpoint_that_holds_the_run(tmp_path):
    out = tmp_path / "run"
    a_run_record(out)
    metrics(out, EVAL_ROW, STEP_ROW)
    assert "no checkpoint was written: start it again with another --out" in \
        run.how_to_continue(out)
    (out / "checkpoints" / "step_1").mkdir(parents=True)
    assert f"continue it from step_1 with: python tba.py --resume {out}" in run.how_to_continue(out)
