"""Where each process runs, on machines with 0 to 8 GPUs, checked through a strict fake CUDA
(tests/fake_cuda.py): resolve -> placement -> each process's device set-up, the layout that
--dry-run prints, a run whose searcher processes record the device they were given and every
weight version they loaded, and the trainer's pinned staging for the weights."""
import json
import re

import pytest
import torch
import torch.multiprocessing as mp

import config
from devices import placement
import tba
from fake_cuda import PINNED, FakeCuda, set_devices
from tasks.toy import build_model, build_tokenizer
from devices.sync_check import probe_logp
from devices.weights import WeightChannel, copy_weights


def fake_gpus(monkeypatch, count, log=None):
    """This process and every process it spawns see `count` fake GPUs."""
    for name, value in FakeCuda.environment(count, log or "").items():
        monkeypatch.setenv(name, value)
    return FakeCuda(count, log=log).install(monkeypatch.setattr)


def dry_run_layout(capsys, *args):
    """`tba.py --task gsm8k --dry-run ARGS` -> {process: device} as the settings block prints it."""
    assert tba.main(["--task", "gsm8k", "--dry-run", *args]) == 0
    out = capsys.readouterr().out
    return dict(re.findall(r"^    (trainer|searcher \d+) +(\S+),", out, re.M)), out


@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
@pytest.mark.parametrize("trainer_gpu", [None, 1])
def test_dry_run_puts_the_trainer_alone_on_its_gpu(gpus, trainer_gpu, monkeypatch, capsys):
    """Every device indexed; one GPU: everything on cuda:0; two or more: the trainer alone on
    its GPU (cuda:0, or the one --device cuda:k names) and the searchers on the others, in turn.
    --searchers defaults to one per other GPU (one with a single GPU)."""
    if trainer_gpu is not None and trainer_gpu >= gpus:
        pytest.skip("no such GPU")
    fake_gpus(monkeypatch, gpus)
    args = [] if trainer_gpu is None else ["--device", f"cuda:{trainer_gpu}"]
    layout, out = dry_run_layout(capsys, *args)
    trainer = f"cuda:{trainer_gpu or 0}"
    searchers = [layout[f"searcher {i}"] for i in range(len(layout) - 1)]
    assert layout["trainer"] == trainer
    assert all(re.fullmatch(r"cuda:\d", d) for d in layout.values())
    assert f"where it runs ({gpus} GPU" in out and "shared memory" in out
    if gpus == 1:
        assert searchers == ["cuda:0"]
    else:
        assert len(searchers) == gpus - 1
        assert sorted(searchers) == sorted(f"cuda:{i}" for i in range(gpus) if f"cuda:{i}" != trainer)
    # more searchers than GPUs: still never on the trainer's, spread evenly over the others
    layout, _ = dry_run_layout(capsys, *args, "--searchers", "5")
    searchers = [layout[f"searcher {i}"] for i in range(5)]
    if gpus >= 2:
        assert trainer not in searchers
        counts = [searchers.count(d) for d in set(searchers)]
        assert max(counts) - min(counts) <= 1
    else:
        assert searchers == ["cuda:0"] * 5


def test_no_gpu_and_bare_cuda(monkeypatch, capsys):
    """No GPU: everything on the CPU, the cores split; --device cuda (no index) is cuda:0."""
    fake_gpus(monkeypatch, 0)
    layout, out = dry_run_layout(capsys)
    assert set(layout.values()) == {"cpu"} and "(no GPU," in out
    fake_gpus(monkeypatch, 2)
    layout, _ = dry_run_layout(capsys, "--device", "cuda")
    assert layout == {"trainer": "cuda:0", "searcher 0": "cuda:1"}


@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
def test_every_process_sets_itself_up_on_the_device_it_was_given(gpus, monkeypatch, tmp_path):
    """resolve -> placement -> `set_up_process` for the trainer and each searcher, through the
    fake's strict `set_device` (which refuses "cuda" as torch does): every call succeeds, each on
    the device the layout names, and the tensors of a faked GPU go to the CPU."""
    log = tmp_path / "set_device.log"
    fake = fake_gpus(monkeypatch, gpus, log)
    cfg = config.resolve(config.parse_args(["--task", "toy", "--searchers", "3"])[0])
    layout = placement.plan_layout(cfg)
    for device in [layout.device, *layout.searcher_devices]:
        assert placement.set_up_process(device, layout.threads) == torch.device("cpu")
        assert fake.current == torch.device(device).index
    assert [line.split()[1] for line in log.read_text().splitlines()] == [
        str(layout.device), *layout.searcher_devices]
    assert torch.get_num_threads() == layout.threads
    with pytest.raises(ValueError, match="index"):
        placement.set_up_process("cuda", 1)
    with pytest.raises(ValueError, match="specified index"):
        torch.cuda.set_device(torch.device("cuda"))          # the fake refuses as torch does


@pytest.mark.parametrize("cudnn, env, on", [(92000, None, False), (92501, None, False),
                                             (92600, None, False), (92700, None, True),
                                             (92000, "1", True), (92700, "0", False)])
def test_cudnn_attention_is_off_where_its_backward_is_known_to_return_nan(cudnn, env, on,
                                                                        monkeypatch, capsys):
    """cuDNN up to 9.26 has a NaN attention backward (pytorch/pytorch#196678 and
    NVIDIA/cudnn-frontend#1072): each process's set-up turns cuDNN's SDPA off there, the layout
    says so in one line, and TBA_CUDNN_SDPA=1 or 0 decides instead where a user sets it."""
    FakeCuda(1, cudnn=cudnn).install(monkeypatch.setattr)
    if env is None:
        monkeypatch.delenv(placement.CUDNN_SDPA_ENV, raising=False)
    else:
        monkeypatch.setenv(placement.CUDNN_SDPA_ENV, env)
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(not on)
        placement.set_up_process("cuda:0", 1)
        assert torch.backends.cuda.cudnn_sdp_enabled() == on
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
    _, out = dry_run_layout(capsys)
    line = next(line for line in out.splitlines() if "cuDNN attention" in line)
    version = f"cuDNN 9.{cudnn // 100 % 100}.{cudnn % 100}"
    assert version in line and line.split("cuDNN attention ")[1].startswith("on" if on else "off")
    if not on and env is None:
        assert "pytorch/pytorch#196678" in line and "TBA_CUDNN_SDPA=1" in line


def test_a_bad_cudnn_attention_setting_is_one_error_line(monkeypatch, capsys):
    fake_gpus(monkeypatch, 1)
    monkeypatch.setenv(placement.CUDNN_SDPA_ENV, "yes")
    assert tba.main(["--task", "gsm8k", "--dry-run"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: TBA_CUDNN_SDPA='yes': set it to 1 (cuDNN's attention on) or 0 (off), or unset "
        "it to decide by the cuDNN version"]


def test_a_run_with_searchers_on_the_other_gpus(monkeypatch, tmp_path):
    """Four fake GPUs, the trainer on cuda:1, two searcher processes: each process sets up the
    device the layout gives it (searchers on cuda:0 and cuda:2, none on the trainer's), each
    searcher loads newer weights only, every one a published version (the first is the newest
    when it is ready: version 0, or later for one that started slowly), and the probe's
    log-prob under each load is the trainer's."""
    log, run = tmp_path / "set_device.log", tmp_path / "run"
    fake_gpus(monkeypatch, 4, log)
    assert tba.main(["--task", "toy", "--device", "cuda:1", "--searchers", "2", "--steps", "60",
                     "--sync-every", "2", "--eval-every", "100", "--quiet",
                     "--out", str(run)]) == 0
    layout = json.loads((run / "config.json").read_text())["layout"]
    assert layout["trainer"] == "cuda:1" and layout["searchers"] == ["cuda:0", "cuda:2"]
    by_pid = set_devices(log)
    assert sorted(d for devices in by_pid.values() for d in devices) == ["cuda:0", "cuda:1", "cuda:2"]
    assert all(len(devices) == 1 for devices in by_pid.values())       # one set-up per process
    loads = [json.loads(line) for line in open(run / "weights.jsonl")]
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    for rank in (0, 1):
        mine = [r for r in loads if r["rank"] == rank]
        versions = [r["loaded"] for r in mine]
        assert versions and versions == sorted(set(versions))
        assert all(v % 2 == 0 and v <= 60 for v in versions)
        assert {r["device"] for r in mine} == {layout["searchers"][rank]}
        assert by_pid[mine[0]["pid"]] == [layout["searchers"][rank]]
    assert 0 in [r["loaded"] for r in loads]           # the weights the run started from
    diffs = [r["sync_probe_diff_max"] for r in rows if "sync_probe_diff_max" in r]
    assert diffs and max(diffs) < 1e-4
    synced = [r for r in rows if "loss" in r and r["step"] % 2 == 0]
    assert all("sync_to_host_s" in r and "sync_to_slot_s" in r for r in synced)


def hold(channel, ready, done):
    """A searcher's side of the staging test: receive the channel, say so, wait."""
    ready.set()
    done.wait(60)


def saved_run(monkeypatch, tmp_path, gpus):
    """A toy run with one searcher on `gpus` fake GPUs, stopped at its step-2 checkpoint."""
    run = tmp_path / f"saved-on-{gpus}"
    fake_gpus(monkeypatch, gpus)
    assert tba.main(["--task", "toy", "--searchers", "1", "--steps", "2", "--save-every", "2",
                     "--group-size", "8", "--eval-every", "0", "--out", str(run)]) == 0
    return run


@pytest.mark.parametrize("before, after", [(4, 1), (4, 8), (1, 4), (8, 4)])
def test_a_run_resumes_on_another_number_of_gpus(before, after, monkeypatch, tmp_path, capsys):
    """A checkpoint keeps the random state of every GPU the run saw. Resumed on a machine with
    fewer, the states of the GPUs there are restored and one line says which were dropped (not
    an IndexError from torch.cuda.set_rng_state_all); with more, the others keep the seed's.
    Each resumed run lays out its processes on the GPUs it has, and says so."""
    run = saved_run(monkeypatch, tmp_path, before)
    capsys.readouterr()
    fake_gpus(monkeypatch, after)
    assert tba.main(["--resume", str(run), "--steps", "3"]) == 0
    out, err = capsys.readouterr()
    layout = dict(re.findall(r"^    (trainer|searcher \d+) +(\S+),", out, re.M))
    assert layout == {"trainer": "cuda:0", "searcher 0": "cuda:0" if after == 1 else "cuda:1"}
    dropped = [line for line in err.splitlines() if "random states" in line]
    if after < before:
        assert dropped == [f"note: the checkpoint holds the random states of {before} GPUs and "
                           f"this machine has {after}: those of cuda:{after}–cuda:{before - 1} "
                           "are dropped"]
    else:
        assert not dropped
    steps = [json.loads(line)["step"] for line in open(run / "metrics.jsonl")]
    assert max(steps) == 3


def test_the_trainers_staging_stays_pinned_and_private(monkeypatch):
    """The pinned staging a GPU trainer publishes through is made at the first publish, before
    the searchers are spawned with the channel: sending it to them must not move it to shared
    memory (where it stops being pinned and is a third copy of the weights in /dev/shm)."""
    fake_gpus(monkeypatch, 1)
    ctx = mp.get_context("spawn")
    model = build_model(len(build_tokenizer()))
    channel = WeightChannel(model, 1, ctx, device="cuda:0")
    legs = channel.publish(model, 0)
    assert set(legs) == {"sync_to_host_s", "sync_to_slot_s"}
    assert all(t.data_ptr() in PINNED for t in channel.staging.values())
    ready, done = ctx.Event(), ctx.Event()
    child = ctx.Process(target=hold, args=(channel, ready, done))
    child.start()
    try:
        assert ready.wait(60)
        assert not any(t.is_shared() for t in channel.staging.values())
        assert all(t.is_pinned() for t in channel.staging.values())
        shared = sum(t.numel() * t.element_size() for slot in channel.slots for t in slot.values())
        assert shared == WeightChannel.bytes_needed(model)
    finally:
        done.set()
        child.join()
        channel.close()


def test_the_probe_tells_a_failed_sync():
    """The probe's log-prob is the same for the same weights and differs for others: a searcher
    that copied the weights gets the trainer's number, one that did not does not."""
    tokenizer = build_tokenizer()
    trained, searcher_copy = build_model(len(tokenizer)), build_model(len(tokenizer))
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.01 * torch.randn_like(p))
    assert probe_logp(searcher_copy) != probe_logp(trained)
    copy_weights(searcher_copy, {k: v for k, v in trained.state_dict().items()})
    assert probe_logp(searcher_copy) == probe_logp(trained)


def test_the_reference_scores_at_least_a_group_a_pass():
    """A no-grad pass keeps no activations: the reference is not split into --micro-completions
    passes (the paper recipe: 7 passes of 20, not 35 of 4); without that flag nothing changes."""
    from searcher import reference_pass_size
    parse = lambda *args: config.resolve(config.parse_args(["--task", "toy", *args])[0])
    assert reference_pass_size(parse("--group-size", "20", "--micro-completions", "4")) == 20
    assert reference_pass_size(parse("--group-size", "4", "--micro-completions", "8")) == 8
    assert reference_pass_size(parse("--group-size", "8", "--micro-groups", "1")) == 8
    assert reference_pass_size(parse("--micro-groups", "0")) == 0                  # all at once
