"""What one step really runs: traced in process, the searcher's sampling and the trainer's step.

The options plug into the core where the run is assembled (assembly/load.py): the core files
import none of them, and with every option off no line of options/ runs during a step.
"""
import ast
import inspect
import queue
import re
import sys
from pathlib import Path

import pytest
import torch.multiprocessing as mp

import config
import searcher
import tba
import trainer
from assembly import load
from devices.sync_check import receive_weights
from devices.weights import WeightChannel
from test_readme import reading_order

REPO = Path(__file__).resolve().parents[1]
CORE = ("tba.py", "searcher.py", "buffer.py", "trainer.py", "batch.py")


def test_the_core_imports_no_option():
    for name in CORE:
        tree = ast.parse((REPO / name).read_text())
        imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        imported += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert not [m for m in imported if m.split(".")[0] == "options"], name


def files_run(fn):
    """The project's files (relative paths) whose Python code runs in fn(), in the order each is
    first entered: -> {file: the qualified names of its functions that ran}"""
    seen = {}

    def profile(frame, event, arg):
        if event == "call":
            path = Path(frame.f_code.co_filename)
            if path.is_relative_to(REPO) and "tests" not in path.parts:
                seen.setdefault(str(path.relative_to(REPO)), set()).add(frame.f_code.co_qualname)
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


def traced_step(tmp_path, *flags):
    """One step of `python tba.py --task toy FLAGS`, in this process: with searchers, a searcher
    samples a batch into the buffer, the trainer draws from it, steps, and publishes the weights,
    which the searcher loads; without, the synchronous source samples and the trainer steps.
    -> {file that ran: its functions that ran}, in the order the files were first entered"""
    cfg, _, _ = config.parse_args(["--task", "toy", "--steps", "2", "--group-size", "4",
                                   "--prompts-per-step", "2", "--quiet",
                                   "--out", str(tmp_path / "run"), *flags])
    cfg = config.resolve(cfg)
    setup = load.load(cfg)                        # assembling the run: not the step
    source, policy = setup.source, setup.policy
    reports = queue.Queue()
    if cfg.searchers:
        one = searcher.Searcher(0, cfg, "cpu", 1, source.options)
        source.weights = WeightChannel(policy, 1, mp.get_context("spawn"))
        source.publish(policy, 0)
        receive_weights(one, source.weights, -1, reports, block=True)
        one.start(0)

    def step():
        if cfg.searchers:
            prompt_ids, batch, report = one.search(0)
            source.buffer.add_batch(prompt_ids, batch)
            source.take_reports([report])
        batch, _ = source.next_batch(0)
        trainer.train_step(policy, setup.optimizer, setup.scheduler, batch, beta=cfg.beta,
                           loss=setup.loss, temperature=cfg.temperature,
                           micro_groups=cfg.micro_groups, max_grad_norm=cfg.max_grad_norm,
                           version=0)
        source.publish(policy, 1)
        if cfg.searchers:
            receive_weights(one, source.weights, 0, reports)
    try:
        return files_run(step)
    finally:
        if cfg.searchers:
            source.weights.close()


@pytest.mark.parametrize("searchers", ["0", "1"])
def test_with_every_option_off_no_option_code_runs_in_a_step(tmp_path, searchers):
    ran = traced_step(tmp_path, "--searchers", searchers)
    assert {"searcher.py", "trainer.py", "batch.py"} <= set(ran)
    assert (searchers == "1") == ("buffer.py" in ran)
    assert not [f for f in ran if f.startswith("options/")], ran


def test_an_option_that_is_on_runs_in_the_step(tmp_path):
    """The tracer sees options: a corrected loss and an explorative sampler run theirs."""
    ran = traced_step(tmp_path, "--searchers", "0", "--loss", "tb-topr",
                      "--search-temperature", "0.5", "2.0")
    assert {"options/losses.py", "options/stale_tb.py", "options/exploration.py"} <= set(ran)


def test_the_readme_reading_order_is_the_path_one_step_takes(tmp_path):
    """The README's table lists tba.py (the loop), then every file one step of `--task toy
    --searchers 1` enters, in the order it first enters them; the function each row names first
    is one the step ran. tba.py's `train` is the loop whose body the traced step repeats."""
    ran = traced_step(tmp_path, "--searchers", "1")
    rows = [(name, what) for name, _, what in reading_order()[1]]
    assert rows[0][0] == "tba.py"
    assert [name for name, _ in rows[1:]] == list(ran), "README's reading order != the traced path"
    for name, what in rows[1:]:
        first = re.search(r"`([\w.]+)`", what).group(1)
        assert any(q == first or q.endswith("." + first) or q.startswith(first + ".")
                   for q in ran[name]), f"{name}: the step never ran `{first}`"
    loop = inspect.getsource(tba.train)
    for call in ("source.next_batch(", "trainer.train_step(", "source.publish("):
        assert call in loop, f"tba.train no longer calls {call}: update traced_step"
