"""The asynchronous engine with real processes: weight sync, searchers, failure handling."""
import json
import os
import signal
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.multiprocessing as mp

import config
from plumbing import errors
from engines import processes
import tasks
from assembly import load
from buffer import ReplayBuffer
from devices.weights import WeightChannel
from tasks.toy import build_model, build_tokenizer

REPO = Path(__file__).resolve().parents[1]


def fill(model, value):
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)


def read_versions(channel, n_loads, results):
    """Searcher side of the fingerprint test: every loaded state dict must be one version."""
    model = build_model(len(build_tokenizer()))
    version, seen, torn = -1, [], 0
    while len(seen) < n_loads:
        new = channel.receive(model, 0, version, block=True)
        values = torch.cat([p.flatten() for p in model.parameters()])
        torn += int(not torch.all(values == values[0]) or values[0].item() != new)
        if new != version:
            seen.append(new)
        version = new
    results.put((seen, torn))


def test_weight_sync_never_mixes_versions():
    ctx = mp.get_context("spawn")
    model = build_model(len(build_tokenizer()))
    channel = WeightChannel(model, n_readers=1, ctx=ctx)
    storages = [t.untyped_storage().data_ptr() for slot in channel.slots for t in slot.values()]
    results = ctx.Queue()
    reader = ctx.Process(target=read_versions, args=(channel, 20, results))
    reader.start()
    version, deadline = 0, time.time() + 120
    while results.empty() and time.time() < deadline:
        version += 1
        fill(model, float(version))          # the fingerprint: every weight equals the version
        channel.publish(model, version)
    seen, torn = results.get(timeout=60)
    reader.join(10)
    assert torn == 0
    assert seen == sorted(seen) and len(seen) == 20 and seen[-1] <= version
    # publishing reuses the two shared slots: shared memory does not grow from sync to sync
    assert storages == [t.untyped_storage().data_ptr() for slot in channel.slots for t in slot.values()]


def assert_all_exit(processes):
    """No orphans: every child (searchers, multiprocessing's resource tracker) ends within seconds."""
    _, alive = psutil.wait_procs(processes, timeout=10)
    assert not alive


def run_tba(tmp_path, *args, timeout=600):
    return subprocess.run([sys.executable, "tba.py", "--task", "toy", "--out", str(tmp_path), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)


def rows(path):
    lines = [json.loads(line) for line in open(path)]
    return [r for r in lines if "loss" in r], [r for r in lines if "toy/tv" in r]


def test_publishes_alternate_slots_so_a_reader_never_blocks_the_trainer():
    """With --sync-every 2 the versions are all even: the slot must follow the publish count,
    or every publish lands in one slot and waits for whoever is reading it."""
    channel = WeightChannel(build_model(len(build_tokenizer())), 1, mp.get_context("spawn"))
    model = build_model(len(build_tokenizer()))
    channel.publish(model, version=2)
    channel.publish(model, version=4)
    assert sorted(channel.slot_version.tolist()) == [2, 4]
    reading = channel.slot_version.tolist().index(4)
    channel.locks[reading].acquire()                  # a searcher copying version 4 out
    try:
        publisher = threading.Thread(target=channel.publish, args=(model, 6))
        publisher.start()
        publisher.join(timeout=10)
        assert not publisher.is_alive(), "the trainer waited on the slot being read"
        assert sorted(channel.slot_version.tolist()) == [4, 6]
    finally:
        channel.locks[reading].release()
        channel.close()


TRAINER_HOLDING_THE_LOCK = """
import sys, time, torch, torch.multiprocessing as mp
import config, searcher, tasks
from engines import processes
from buffer import ReplayBuffer
from devices.weights import WeightChannel
cfg = config.resolve(config.parse_args(["--task", "toy", "--searchers", "1", "--out", sys.argv[1]])[0])
policy, tokenizer = tasks.make_task(cfg).load_model(torch.device("cpu"))
buffer = ReplayBuffer(cfg.buffer_capacity, cfg.group_size, 1, cfg.max_new_tokens, n_prompts=2,
                      pad_id=tokenizer.pad_token_id)
weights = WeightChannel(policy, 1, mp.get_context("spawn"))
weights.publish(policy, version=0)
pool = processes.SearcherPool(cfg, ["cpu"], 1, buffer, weights)
while len(buffer) < cfg.prompts_per_step:
    time.sleep(0.05)
buffer._lock.acquire()                  # the searcher's next `add` waits on this for ever
print(pool.processes[0].pid, flush=True)
time.sleep(600)
"""


def test_searcher_dies_with_a_killed_trainer_even_while_waiting_on_its_lock(tmp_path):
    shm_before = set(os.listdir("/dev/shm"))
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER_HOLDING_THE_LOCK, str(tmp_path)],
                               cwd=REPO, stdout=subprocess.PIPE, text=True)
    children = []
    try:
        searcher_pid = int(trainer.stdout.readline())
        children = psutil.Process(trainer.pid).children(recursive=True)
        time.sleep(2)                                  # the searcher reaches the held lock
        assert psutil.pid_exists(searcher_pid)
        trainer.kill()
        trainer.wait(10)
        _, alive = psutil.wait_procs(children, timeout=10)   # searcher and resource tracker
        assert not alive, f"left running: {alive}"
    finally:
        for process in [trainer, *children]:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
    assert set(os.listdir("/dev/shm")) <= shm_before


def test_two_searchers_run_and_exit_cleanly(tmp_path):
    sync_every, max_staleness, max_reuse = 2, 3, 2
    result = run_tba(tmp_path, "--searchers", "2", "--steps", "40", "--eval-every", "0",
                     "--sync-every", str(sync_every), "--max-staleness", str(max_staleness),
                     "--max-reuse", str(max_reuse), "--search-batch", "4")
    assert result.returncode == 0, result.stderr
    train_rows, eval_rows = rows(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in train_rows] == list(range(1, 41))
    # each search call generates for --search-batch 4 prompts, twice the toy's B = 2
    assert train_rows[-1]["gen_groups"] > 0 and all(r["gen_groups"] % 4 == 0 for r in train_rows)
    for r in train_rows:
        assert 0 <= r["staleness_mean"] <= r["staleness_max"] <= max_staleness
        assert 1 <= r["reuse_mean"] <= max_reuse
        assert r["version"] == r["step"] - 1 and r["buffer_completions"] >= 2 * 64
    assert any(r["staleness_max"] > 0 for r in train_rows)      # data really was off-policy
    assert train_rows[-1]["gen_tokens_per_s"] > 0
    assert "final" in result.stdout


def test_killed_searcher_stops_the_run(tmp_path):
    proc = subprocess.Popen([sys.executable, "tba.py", "--task", "toy", "--searchers", "2",
                             "--steps", "100000", "--eval-every", "0", "--out", str(tmp_path)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and len(rows(metrics)[0]) >= 5):
        time.sleep(0.2)
    children = psutil.Process(proc.pid).children(recursive=True)
    searchers = [c for c in children if "spawn_main" in " ".join(c.cmdline())]
    assert len(searchers) == 2
    os.kill(searchers[1].pid, signal.SIGKILL)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "searcher" in stderr and "died" in stderr and "Traceback" not in stderr
    assert_all_exit(children)
    train_rows, _ = rows(metrics)                       # every line written is intact JSON
    assert len(train_rows) >= 5


NAN_TASK = """
from llm import sampling
from tasks.toy import ToyTask

recorded = sampling.TemperatureAndLogMu.token_logp
calls = []


def nan_from_the_third_batch(self, new_ids):      # what a GPU kernel's NaN would leave
    calls.append(1)
    logp = recorded(self, new_ids)
    return logp * float("nan") if len(calls) >= 3 else logp


sampling.TemperatureAndLogMu.token_logp = nan_from_the_third_batch


class NanToy(ToyTask):
    pass
"""


@pytest.mark.parametrize("searchers", [0, 1])
def test_a_nan_log_mu_stops_the_run_naming_the_searcher_step_and_quantity(searchers, tmp_path):
    """A searcher (or the synchronous loop's sampling) whose third batch records a NaN log μ:
    nothing enters the buffer, the run stops with exit 1 and one line that names who, after
    which step, and what was not finite."""
    (tmp_path / "nan_task.py").write_text(NAN_TASK)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    result = subprocess.run([sys.executable, "tba.py", "--task", "nan_task:NanToy", "--searchers",
                             str(searchers), "--steps", "50", "--eval-every", "0",
                             "--out", str(tmp_path / "run")],
                            cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 1, result.stderr
    error = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "Traceback" not in result.stderr, result.stderr
    assert re.search(r"after step \d+: " + ("searcher 0 failed: " if searchers else "")
                     + r"the log μ of the sampled completions is not finite for \d+ of \d+ "
                     r"completions \(e\.g\. nan\), sampled with the weights of version \d+",
                     error[0]), error[0]


def test_searcher_dying_with_a_lock_held_does_not_hang_the_trainer(tmp_path):
    """A searcher killed inside `buffer.add` leaves the buffer's lock held for ever. The trainer
    blocked on that lock must still get the SearcherError, not hang. The held lock is made by
    taking it here, so that the trainer's next `buffer.drawable_groups` blocks as it would."""
    cfg = config.resolve(config.parse_args(["--task", "toy", "--searchers", "1",
                                      "--out", str(tmp_path)])[0])
    task = tasks.make_task(cfg)
    policy, tokenizer = task.load_model(torch.device("cpu"))
    buffer = ReplayBuffer(cfg.buffer_capacity, cfg.group_size, 1, cfg.max_new_tokens,
                          n_prompts=2, pad_id=tokenizer.pad_token_id)
    weights = WeightChannel(policy, 1, mp.get_context("spawn"))
    weights.publish(policy, version=0)
    pool = processes.SearcherPool(cfg, ["cpu"], 1, buffer, weights)
    pool.watch()

    def hung(signum, frame):
        raise TimeoutError("the trainer hung on the lock its dead searcher held")
    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(120)
    try:
        while len(buffer) == 0:                   # the searcher is up and writing
            pool.poll()
            time.sleep(0.05)
        buffer._lock.acquire()
        os.kill(pool.processes[0].pid, signal.SIGKILL)
        start = time.time()
        with pytest.raises(errors.SearcherError, match="died"):
            buffer.drawable_groups()                        # blocks on the held lock until interrupted
        assert time.time() - start < 30
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        pool.close()
        weights.close()


def test_stale_replayed_data_still_reaches_the_target(tmp_path):
    """TB is valid off-policy: half of each batch replayed from anywhere in the buffer, weights
    shipped every 4 steps, and the policy still matches p* exactly enough."""
    result = run_tba(tmp_path, "--searchers", "1", "--recent-frac", "0.5", "--sync-every", "4")
    assert result.returncode == 0, result.stderr
    train_rows, eval_rows = rows(tmp_path / "metrics.jsonl")
    assert max(r["staleness_max"] for r in train_rows) >= 4
    assert eval_rows[0]["toy/tv"] > 0.5 and eval_rows[-1]["toy/tv"] <= 0.1


def test_interrupt_stops_cleanly(tmp_path):
    """Ctrl-C (SIGINT) or `kill` (SIGTERM): a clear line, no orphans, no leaked semaphores."""
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    for sig, name in [(signal.SIGINT, "int"), (signal.SIGTERM, "term")]:
        out = tmp_path / name
        proc = subprocess.Popen([sys.executable, "tba.py", "--task", "toy", "--searchers", "1",
                                 "--steps", "100000", "--eval-every", "0", "--out", str(out)],
                                cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 120
        while time.time() < deadline and not ((out / "metrics.jsonl").exists()
                                               and len(rows(out / "metrics.jsonl")[0]) >= 5):
            time.sleep(0.2)
        children = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 130 and "interrupted" in stderr
        assert "Traceback" not in stderr
        assert_all_exit(children)
        assert len(rows(out / "metrics.jsonl")[0]) >= 5
    if os.path.isdir("/dev/shm"):
        assert set(os.listdir("/dev/shm")) <= shm_before


def test_trainer_keeps_no_reference_copy_when_searchers_score_it(tiny_model_dir, tmp_path):
    """With searchers the reference log-probs come in the buffer: the trainer holds a frozen
    copy only for the synchronous loop or a task whose evaluation needs it (the toy's exact p*)."""
    def setup(*args):
        cfg = config.parse_args([*args, "--out", str(tmp_path / "run")])[0]
        return load.load(config.resolve(cfg))
    arith = ["--task", "arith", "--model", str(tiny_model_dir)]
    assert setup(*arith, "--searchers", "1").ref_model is None
    assert setup(*arith, "--searchers", "0").ref_model is not None
    assert setup("--task", "toy", "--searchers", "1").ref_model is not None
