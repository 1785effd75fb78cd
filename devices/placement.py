"""Where each process of a run works: its device, its CPU threads, and the shared memory between them.

One place decides it (`placement`), every process sets itself up with what it was given
(`set_up_process`), and `describe` prints it in the settings block of every run and --dry-run:

    GPUs   trainer        searchers (N of them)
    0      cpu            cpu                         cores split between the N + 1 processes
    1      cuda:0         cuda:0 (shared)
    G >= 2 cuda:t         the other G - 1 GPUs, in turn   (t = 0, or k with --device cuda:k)

A device is always indexed (`cuda:0`, never `cuda`): `torch.cuda.set_device` refuses a bare
one. With two or more GPUs the trainer's GPU is its own: a searcher's `generate` beside the
trainer's step would take its memory and its time. CPU threads are split on a GPU machine too:
a searcher's tokenising, scoring and Python work, and the trainer's, are CPU work, and
processes that each take every core slow each other down more than they gain.

Only `torch.cuda.device_count`, `is_available`, `is_bf16_supported`, `set_device` and
`torch.backends.cudnn.version` are asked of CUDA here, and `tensor_device` is where a process's tensors go: the tests replace these with a
strict fake (tests/fake_cuda.py) to check all of this on a machine without a GPU.
"""
import ctypes
import ctypes.util
import functools
import importlib.util
import math
import os
import re
import shutil
import signal
import sys
from dataclasses import dataclass

import torch

GB = 1024 ** 3


@dataclass
class Layout:
    """Where each process runs (`placement`)."""
    device: torch.device              # the trainer's
    searcher_devices: list            # one per searcher, e.g. ["cuda:1", "cuda:2"]
    threads: int                      # CPU threads of each process
    gpus: int = 0                     # GPUs this machine has
    cores: int = 1                    # CPU cores this process may use
    ray: bool = False                 # searchers are Ray actors (a device on their own node)


def gpu_count():
    """The CUDA GPUs torch can use here (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def usable_cores():
    """The cores this process may run on: `taskset -c 0 python tba.py` gives one."""
    cores = os.cpu_count() or 1
    if hasattr(os, "sched_getaffinity"):
        cores = min(cores, len(os.sched_getaffinity(0)))
    return cores


def default_device():
    """--device auto: the first GPU if there is one, else the CPU."""
    return "cuda:0" if gpu_count() else "cpu"


def indexed(device):
    """'cuda' -> 'cuda:0'; any other device as it is. -> str"""
    device = torch.device(device)
    return f"cuda:{device.index or 0}" if device.type == "cuda" else str(device)


def check(cfg):
    """Where the run can go: --device names a device this machine has, --searchers fit its CPU
    cores, --ray names a cluster and Ray is installed. Raises ValueError, the `error:` line."""
    if cfg.ray:
        if not cfg.searchers:
            raise ValueError(f"--ray {cfg.ray} runs the searchers as Ray actors, but --searchers "
                             "is 0: use --searchers 1 or more")
        if cfg.ray not in ("local", "auto") and not re.fullmatch(r"(ray://)?[^:\s]+:\d+", cfg.ray):
            raise ValueError(f"--ray {cfg.ray}: pass local, auto, HOST:PORT or ray://HOST:PORT")
        if importlib.util.find_spec("ray") is None:
            raise ValueError(f"--ray {cfg.ray}: Ray is not installed: pip install 'ray==2.60.0' "
                             "(or make install-ray)")
    try:
        device = torch.device(cfg.device)
    except RuntimeError:
        raise ValueError(f"--device {cfg.device!r} is not a torch device: use auto, cpu, cuda "
                         "or cuda:N") from None
    if device.type == "cuda":
        gpus = gpu_count()
        if not gpus:
            raise ValueError(f"--device {cfg.device}: this machine has no CUDA GPU that torch "
                             "can use: use --device cpu")
        if device.index is not None and device.index >= gpus:
            raise ValueError(f"--device {cfg.device}: this machine has {gpus} GPU(s), "
                             f"cuda:0 to cuda:{gpus - 1}")
    elif device.type != "cpu":
        raise ValueError(f"--device {cfg.device}: tba runs on cpu or cuda devices")
    cores = os.cpu_count() or 1
    if device.type == "cpu" and cfg.ray in ("", "local") and cfg.searchers > cores:
        raise ValueError(f"--searchers {cfg.searchers} needs at least one CPU core each but this "
                         f"machine has {cores}: use --searchers {cores} or fewer")


def plan_layout(cfg):
    """The trainer on --device (indexed); the searchers on the other GPUs when there are two or
    more, on the one GPU or the CPU otherwise; the usable cores split evenly. Ray actors get
    `cuda:0` where Ray gives them a GPU (it sets CUDA_VISIBLE_DEVICES to theirs). -> Layout"""
    device = torch.device(indexed(cfg.device))
    gpus = gpu_count() if device.type == "cuda" else 0
    if cfg.ray:
        searcher_devices = ["cuda:0" if gpus else "cpu"] * cfg.searchers
    elif gpus >= 2:
        others = [i for i in range(gpus) if i != device.index]
        searcher_devices = [f"cuda:{others[i % len(others)]}" for i in range(cfg.searchers)]
    else:
        searcher_devices = [str(device)] * cfg.searchers
    cores = usable_cores()
    return Layout(device, searcher_devices, max(1, cores // (cfg.searchers + 1)), gpus=gpus,
                  cores=cores, ray=bool(cfg.ray))


def tensor_device(device):
    """The torch.device a process given `device` puts its tensors on: that device. (The tests'
    fake CUDA puts them on the CPU, the rest of the process's set-up unchanged.)"""
    return torch.device(device)


def set_up_process(device, threads):
    """What each process (the trainer, every searcher) does first: its CPU threads, and, on a GPU,
    make `device` the current one (libraries that use "the current GPU" use ours) with TF32
    matmuls (float32 matmuls on tensor cores with a 10-bit mantissa: 8× the float32 rate of an
    A100); trainer and searchers both do it, so their float32 log-probs are computed alike.
    -> the torch.device its tensors go to"""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        raise ValueError(f"device {device} has no index: placement gives every process cuda:N")
    torch.set_num_threads(threads)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        torch.backends.cuda.enable_cudnn_sdp(cudnn_attention()[0])
    return tensor_device(device)


# cuDNN's scaled-dot-product attention returns NaN in its backward pass when a row of the mask
# hides every key and the key length is 64 mod 128 (pytorch/pytorch#196678, fixed by a cuDNN
# upgrade that torch guards up to 9.25.1 in pytorch/pytorch#196861), and another backward NaN
# is reported on 9.26 on an H200 (NVIDIA/cudnn-frontend#1072). From torch 2.11 SDPA prefers
# cuDNN on sm90 cards. tba's masks leave no row empty (`logprobs.prompt_attention_mask`); this
# keeps the kernel off too where the installed cuDNN is one of those named.
CUDNN_SDPA_SOUND_FROM = 92700     # cuDNN 9.27.0, as torch.backends.cudnn.version() writes it
CUDNN_SDPA_ENV = "TBA_CUDNN_SDPA"  # 1: cuDNN's attention on whatever the version, 0: off


def cudnn_attention():
    """Whether this process lets SDPA use cuDNN's attention, and why, in words.  -> (bool, str)
    The environment variable TBA_CUDNN_SDPA (1 or 0) decides where set; otherwise it is on only
    where the installed cuDNN is newer than every version with a known NaN backward."""
    choice = os.environ.get(CUDNN_SDPA_ENV, "")
    if choice not in ("", "0", "1"):
        raise ValueError(f"{CUDNN_SDPA_ENV}={choice!r}: set it to 1 (cuDNN's attention on) or 0 "
                         f"(off), or unset it to decide by the cuDNN version")
    version = torch.backends.cudnn.version() if torch.cuda.is_available() else None
    named = (f"cuDNN {version // 10000}.{version // 100 % 100}.{version % 100}" if version
             else "no cuDNN")
    if choice:
        return choice == "1", f"{'on' if choice == '1' else 'off'} ({CUDNN_SDPA_ENV}={choice}, {named})"
    if version is not None and version >= CUDNN_SDPA_SOUND_FROM:
        return True, f"on ({named}, newer than the versions with a NaN backward)"
    return False, (f"off: {named} has a NaN attention backward (pytorch/pytorch#196678); "
                   f"{CUDNN_SDPA_ENV}=1 turns it on")


def describe(layout, shared_bytes=None, shm="/dev/shm"):
    """The layout as the settings block prints it: each process, its device and threads, and the
    shared memory the run needs (`shared_bytes`; None: sized once the model loads)."""
    gpus = f"{layout.gpus} GPU{'s' if layout.gpus != 1 else ''}" if layout.gpus else "no GPU"
    lines = [f"  where it runs ({gpus}, {layout.cores} CPU core{'s' if layout.cores != 1 else ''}):",
             f"    trainer     {layout.device}, {layout.threads} thread(s)"]
    where = " (Ray actors, on their own nodes)" if layout.ray else ""
    for rank, device in enumerate(layout.searcher_devices):
        lines.append(f"    searcher {rank:<2} {device}, {layout.threads} thread(s){where}")
    if layout.gpus:
        lines.append(f"    cuDNN attention {cudnn_attention()[1]}")
    if layout.searcher_devices and not layout.ray:
        need = ("two copies of the weights + the replay buffer (sized when the model loads)"
                if shared_bytes is None else f"{shared_bytes / GB:.2f} GB")
        free = f"; {shm} has {shutil.disk_usage(shm).free / GB:.1f} GB free" if os.path.isdir(shm) else ""
        lines.append(f"    shared memory: {need}{free}")
    return "\n".join(lines)


def check_shared_memory(need, shm="/dev/shm"):
    """The weight slots and the replay buffer live in /dev/shm. Docker gives a container 64 MB
    of it, and writing past the end kills a process with a bus error, not a message: so check
    the space before anything is put there."""
    if not os.path.isdir(shm):
        return
    free = shutil.disk_usage(shm).free
    if need > free:
        raise ValueError(f"{shm} has {free / 2**20:.0f} MB free but the weight slots and the "
                         f"replay buffer need {need / 2**20:.0f} MB: give the container more "
                         f"(docker run --shm-size={math.ceil(need * 1.5 / 2**30)}g), or lower "
                         "--buffer-capacity, or run with --searchers 0")


def release_freed_heap(device):
    """Hand the heap that a step's activations freed back to the system (CPU only: a GPU's
    activations are not on the heap). glibc keeps freed memory for reuse: ~1.9 GiB after an
    arith step, resident in the trainer between steps while the searchers need memory too;
    asking for it again costs the next step no measurable time (bench/memory.py arith). Without
    glibc (macOS, musl) there is no malloc_trim: nothing done."""
    if torch.device(device).type == "cpu" and hasattr(libc(), "malloc_trim"):
        libc().malloc_trim(0)


@functools.cache
def libc():
    """The C library, loaded the first time it is needed."""
    return ctypes.CDLL(ctypes.util.find_library("c"))


def die_with_parent():
    """Have the kernel kill this process when the trainer dies (Linux). A searcher checks for its
    parent between batches, but a trainer killed while it holds the buffer's or a weight slot's
    lock leaves the searcher waiting on that lock, where no check runs: without this it would
    wait there for ever, an orphan holding its memory."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1                                   # from <linux/prctl.h>
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL))
