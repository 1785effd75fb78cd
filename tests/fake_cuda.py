"""A strict fake of CUDA, so that placement and every process's device set-up are tested on a
machine without a GPU.

`FakeCuda(n)` makes torch report n GPUs (bfloat16 on unless told otherwise, and a cuDNN
version) and refuses what
the real torch.cuda refuses: `set_device` of an index-less device ("cuda") or of an index past
the last GPU, and `synchronize` likewise. Tensors stay on the CPU (`placement.tensor_device`),
pinned memory is recorded rather than made. Every `set_device` is appended to a log file,
one line "pid device", so a test can see what each process was given.

In a test: `FakeCuda(4).install(monkeypatch.setattr)`. In the searcher processes a run spawns:
`FakeCuda.environment(n, log)` gives the variables that make `fake_cuda_site/sitecustomize.py`
install the same fake when each child's interpreter starts.
"""
import os
from pathlib import Path

import torch
from torch.cuda._utils import _get_device_index

from devices import placement

HERE = Path(__file__).resolve().parent
PINNED = set()                           # data_ptr of the tensors "pinned" here


def fake_pin_memory(tensor, *args, **kwargs):
    """A copy on the CPU, recorded as page-locked (the real call needs a GPU driver)."""
    copy = tensor.clone()
    PINNED.add(copy.data_ptr())
    return copy


def fake_is_pinned(tensor, *args, **kwargs):
    return tensor.data_ptr() in PINNED


class FakeCuda:
    def __init__(self, count, bf16=True, log=None, cudnn=91002):
        self.count, self.bf16, self.log, self.cudnn = count, bf16, log, cudnn   # cuDNN 9.10.2
        self.current = 0
        self.rng = {}                                  # index -> random state (a CPU one's copy)

    def index(self, device):
        """torch's own check (an index is required), then the range check of the driver."""
        index = _get_device_index(device)             # ValueError for "cuda" or a cpu device
        if not 0 <= index < self.count:
            raise RuntimeError(f"CUDA error: invalid device ordinal ({device}, "
                               f"{self.count} GPU(s))")
        return index

    def set_device(self, device):
        self.current = self.index(device)
        if self.log:
            with open(self.log, "a") as f:
                f.write(f"{os.getpid()} cuda:{self.current}\n")

    def synchronize(self, device=None):
        if device is not None:
            self.index(device)

    def rng_index(self, device):
        """torch.cuda's random-state calls take "cuda" (the current GPU), "cuda:N" or N."""
        if isinstance(device, (str, torch.device)) and torch.device(device).index is None:
            return self.current
        return self.index(device)

    def get_rng_state(self, device="cuda"):
        return self.rng.setdefault(self.rng_index(device), torch.get_rng_state())

    def set_rng_state(self, state, device="cuda"):
        self.rng[self.rng_index(device)] = state.clone()

    def install(self, patch):
        """patch(obj, name, value): monkeypatch.setattr in a test, setattr in a child process."""
        patch(torch.cuda, "is_available", lambda: self.count > 0)
        patch(torch.cuda, "device_count", lambda: self.count)
        patch(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: self.bf16)
        patch(torch.cuda, "set_device", self.set_device)
        patch(torch.cuda, "current_device", lambda: self.current)
        patch(torch.cuda, "synchronize", self.synchronize)
        patch(torch.backends.cudnn, "version", lambda: self.cudnn if self.count else None)
        patch(torch.cuda, "get_rng_state", self.get_rng_state)
        patch(torch.cuda, "set_rng_state", self.set_rng_state)
        patch(torch.cuda, "get_rng_state_all",
              lambda: [self.get_rng_state(f"cuda:{i}") for i in range(self.count)])
        patch(torch.cuda, "set_rng_state_all",
              lambda states: [self.set_rng_state(s, f"cuda:{i}") for i, s in enumerate(states)])
        patch(torch.Tensor, "pin_memory", fake_pin_memory)
        patch(torch.Tensor, "is_pinned", fake_is_pinned)
        patch(placement, "tensor_device",
              lambda device: torch.device("cpu") if torch.device(device).type == "cuda"
              else torch.device(device))
        return self

    @staticmethod
    def environment(count, log):
        """Variables that make each spawned child install FakeCuda(count, log=log) at start."""
        paths = [str(HERE / "fake_cuda_site"), str(HERE), str(HERE.parent),
                 os.environ.get("PYTHONPATH", "")]
        return {"TBA_FAKE_CUDA": str(count), "TBA_FAKE_CUDA_LOG": str(log),
                "PYTHONPATH": os.pathsep.join(p for p in paths if p)}

    @staticmethod
    def install_from_environment():
        if os.environ.get("TBA_FAKE_CUDA"):
            FakeCuda(int(os.environ["TBA_FAKE_CUDA"]),
                     log=os.environ.get("TBA_FAKE_CUDA_LOG") or None).install(setattr)


def set_devices(log):
    """The log's lines as {pid: [device, ...]}."""
    devices = {}
    for line in Path(log).read_text().splitlines() if Path(log).exists() else []:
        pid, device = line.split()
        devices.setdefault(int(pid), []).append(device)
    return devices
