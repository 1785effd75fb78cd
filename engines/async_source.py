"""The asynchronous sources: searchers elsewhere fill a replay buffer, and each step draws its
groups from it (`ReplayBuffer.sample`: recency m, priority, staleness and reuse bounds).

`AsyncSource` is what they share; `SearcherProcesses` (--searchers N) starts searcher processes
on this machine (`processes.SearcherPool`), ships them the weights through shared-memory slots
(`devices/weights.py`) and collects their reports in `poll`. Ray's actors are `ray_source.py`'s.
"""
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from devices.placement import GB
from devices.sync_check import LoadLog
from devices.weights import WeightChannel
from engines import processes
from engines.sources import GroupSource


class AsyncSource(GroupSource):
    """A source whose groups come from a replay buffer that searchers elsewhere fill."""

    def __init__(self, cfg, buffer, interrupt):
        self.cfg, self.buffer = cfg, buffer
        self.interrupt = interrupt        # raises KeyboardInterrupt when a stop was requested
        self.draw_generator = torch.Generator().manual_seed(cfg.seed)
        self.fill_target = max(cfg.min_buffer, cfg.prompts_per_step)
        self.tokens = self.groups = 0
        self.infos = []

    def take_reports(self, reports):
        for report in reports:
            self.tokens += report["tokens"]
            self.groups += report["groups"]
            if report["info"] is not None:
                self.infos.append(report["info"])

    def wait_for(self, n_groups, min_version=-1, max_reuse=0, progress=None):
        """Block until the buffer holds n_groups fresh enough, and used few enough times, to
        train on. -> seconds waited"""
        start = time.time()
        while (have := self.buffer.drawable_groups(min_version, max_reuse)) < n_groups:
            if progress is not None and have > progress.n:
                progress.update(have - progress.n)
            self.interrupt()
            self.poll(wait_s=0.01)
        return time.time() - start

    def fill(self, progress=None):
        self.wait_for(self.fill_target, progress=progress)

    def next_batch(self, version):
        cfg = self.cfg
        min_version = version - cfg.max_staleness if cfg.max_staleness >= 0 else -1
        wait_s = self.wait_for(cfg.prompts_per_step, min_version, cfg.max_reuse)
        batch = self.buffer.sample(cfg.prompts_per_step, cfg.recent_frac, cfg.priority_temp or None,
                                   self.draw_generator, min_version, cfg.max_reuse)
        return batch, {"trainer_wait_s": round(wait_s, 4), "search_s": 0.0,
                       "reuse_mean": batch.draws[batch.keep].float().mean().item(),
                       "buffer_completions": len(self.buffer),
                       "recent_frac_actual": batch.recent_count / len(batch.prompt_index),
                       **batch.sampling_metrics(version), **self.load_metrics()}

    def load_metrics(self):
        """What the searchers report of their weight loads: nothing here (Ray's do not)."""
        return {}

    def state_dict(self):
        return {"buffer": self.buffer.state_dict(), "sampler": self.draw_generator.get_state()}

    def load_state_dict(self, state, step):
        """The buffer's groups (checked: none may come from a version after `step`) and the
        sampler's random state; an earlier synchronous session left neither."""
        if "buffer" in state:
            self.buffer.load_state_dict(state["buffer"], max_version=step)
        if "sampler" in state:
            self.draw_generator.set_state(state["sampler"])


class SearcherProcesses(AsyncSource):
    """--searchers N on this machine: spawned processes (processes.SearcherPool) write to the
    shared-memory buffer and read weights from shared-memory slots."""

    def __init__(self, cfg, buffer, layout, interrupt, shared_bytes=0, options=None):
        super().__init__(cfg, buffer, interrupt)
        self.options = options        # searcher.SearchOptions: the options a searcher takes
        self.layout, self.weights, self.pool = layout, None, None
        self.shared_bytes = shared_bytes  # /dev/shm taken by the weight slots and the buffer
        self.loads = LoadLog(Path(cfg.out) / "weights.jsonl", getattr(torch, cfg.dtype))

    def connect(self, quiet=False):
        if not quiet:
            print(f"shared memory: {self.shared_bytes / GB:.2f} GB, the weight slots and the "
                  "replay buffer", flush=True)

    def start(self, policy, version):
        self.weights = WeightChannel(policy, self.cfg.searchers, mp.get_context("spawn"),
                                     device=self.layout.device)
        self.publish(policy, version)
        self.pool = processes.SearcherPool(self.cfg, self.layout.searcher_devices,
                                           self.layout.threads, self.buffer, self.weights,
                                           self.options)
        self.pool.watch()                 # a searcher's death now interrupts the trainer

    def publish(self, policy, version):
        t0 = time.time()
        legs = self.weights.publish(policy, version)
        sync_s = time.time() - t0
        self.loads.published(policy, version)
        return {"sync_s": round(sync_s, 4), **{k: round(v, 4) for k, v in legs.items()}}

    def load_metrics(self):
        return self.loads.metrics()       # the searchers' weight loads since the last batch

    def poll(self, wait_s=0.0):
        self.take_reports(self.loads.take(self.pool.poll()))   # loads logged, searches counted
        time.sleep(wait_s)

    def close(self):
        if self.pool:
            self.pool.close()
        if self.weights:
            self.weights.close()
