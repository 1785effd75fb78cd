"""A check that each weight sync arrived whole: a searcher that goes on sampling from old or
garbled weights still runs, so nothing else would notice.

The trainer computes `probe_logp` of each version it publishes, each searcher of each version it
loads (`receive_weights`), and `LoadLog` compares the two: `sync_probe_diff_max` in every row of
metrics.jsonl, every load in RUN/weights.jsonl.
"""
import json
import os
import time
from pathlib import Path

import torch

from plumbing import checkpoint
from llm import precision


@torch.no_grad()
def probe_logp(model, dtype=torch.float32, length=4):
    """The log-prob of one fixed sequence (a prompt of `length` tokens and a completion of
    `length`) under the model, as the trainer scores: the trainer computes it for the weights
    it publishes, each searcher for the weights it loaded, and the two must agree. -> float"""
    from llm.logprobs import completion_logprobs       # trainer imports nothing of this module
    device = next(model.parameters()).device
    vocab = model.get_input_embeddings().num_embeddings
    ids = (torch.arange(1, 2 * length + 1, device=device) * 7919) % vocab      # [2L]
    with precision.autocast(device, dtype):
        logp = completion_logprobs(model, ids[None, :length], torch.ones_like(ids[None, :length]),
                                   ids[None, length:], torch.tensor([length], device=device),
                                   owner=torch.zeros(1, dtype=torch.long, device=device))
    return logp.item()


def receive_weights(searcher, weights, version, reports, block=False):
    """Load the newest published weights if they are newer than `version`, and report the load:
    the version, where, how long it took, and `probe_logp` under the new weights, which the
    trainer compares with its own. -> the version now held"""
    start = time.perf_counter()
    loaded = weights.receive(searcher.policy, searcher.rank, version, block=block)
    if loaded != version:
        reports.put({"rank": searcher.rank, "pid": os.getpid(), "device": searcher.placed,
                     "loaded": loaded, "load_s": round(time.perf_counter() - start, 4),
                     "probe": probe_logp(searcher.policy, searcher.dtype)})
    return loaded


class LoadLog:
    """The trainer's record of the searchers' weight loads: `probe_logp` of each version it
    published, every load with both probes in RUN/weights.jsonl, and per step the slowest load
    and the largest probe difference (0 when every load arrived whole, or none came)."""

    def __init__(self, path, dtype):
        self.path, self.dtype = Path(path), dtype
        self.probes = {}                  # version -> the trainer's `probe_logp` of it
        self.loads = []                   # the loads reported since the last `metrics`

    def published(self, policy, version):
        self.probes[version] = probe_logp(policy, self.dtype)
        self.probes = dict(list(self.probes.items())[-8:])     # loads are never 8 syncs behind

    def take(self, reports):
        """Log the load reports among `reports`. -> the others (the searches')"""
        loads = [r for r in reports if "loaded" in r]
        for r in loads:
            if r["loaded"] in self.probes:
                r["trainer_probe"] = self.probes[r["loaded"]]
        if loads:
            checkpoint.append_lines(self.path, [json.dumps(r) + "\n" for r in loads])
        self.loads += loads
        return [r for r in reports if "loaded" not in r]

    def metrics(self):
        loads, self.loads = self.loads, []
        diffs = [abs(r["probe"] - r["trainer_probe"]) for r in loads if "trainer_probe" in r]
        return {"searcher_load_s": round(max([r["load_s"] for r in loads], default=0.0), 4),
                "sync_probe_diff_max": max(diffs, default=0.0)}
