"""The searcher: turn prompts into scored groups of completions.

`sample_groups` is one unit of search: K completions for each of B prompts from the current
policy, their rewards from the task, and their log-probs under the frozen reference model. The
synchronous loop calls it in the trainer's process; asynchronous searchers (`run`, started and
watched by `SearcherPool`) call it in a loop in their own processes and write the groups to the
replay buffer. Where the groups go from there is `sources.py`'s concern.
"""
import copy
import ctypes
import multiprocessing
import os
import queue
import random
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import wait as wait_for_any

import torch
import torch.multiprocessing as mp
from transformers.utils import logging as transformers_logging

import models
import tasks
from buffer import GroupBatch
from trainer import group_logprobs


def prompt_batches(prompts, batch_size, seed):
    """Endless batches of prompts: each epoch is a fresh shuffle, so all are seen equally."""
    rng = random.Random(seed)
    order = []
    while True:
        batch = []
        while len(batch) < batch_size:
            if not order:
                order = list(prompts)
                rng.shuffle(order)
            batch.append(order.pop())
        yield batch


@torch.no_grad()
def sample_groups(policy, ref_model, tokenizer, task, prompts, group_size, max_new_tokens,
                  temperature, version=0, stop_event=None, dtype=torch.float32, score_batch=0):
    """Generate, score and reference-score one batch of groups.  -> (GroupBatch, completions)

    The batch carries the behaviour log-probs log μ(y|x) of the weights that sampled it (taken
    during generation, at `temperature`): what importance weights and the staleness metrics of
    `trainer.train_step` need, however old the group is when it is trained on.
    Generation and reference scoring run under the trainer's autocast `dtype`; the reference
    scores `score_batch` sequences per forward pass (0: all B·K at once).
    """
    device = next(policy.parameters()).device
    with models.autocast(device, dtype):
        prompt_ids, prompt_mask, response_ids, response_len, behaviour_logp = models.generate(
            policy, tokenizer, [p.ids for p in prompts], num_samples=group_size,
            max_new_tokens=max_new_tokens, temperature=temperature, stop_event=stop_event,
            with_logprobs=True)
    completions = models.decode(tokenizer, response_ids, response_len)       # B·K strings
    repeated = [p for p in prompts for _ in range(group_size)]
    reward, info = task.score(repeated, completions)
    reward = torch.tensor(reward, dtype=torch.float32)
    batch = GroupBatch(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
        response_len=response_len, reward=reward.view(len(prompts), group_size).to(prompt_ids.device),
        ref_logp=torch.zeros(len(prompts), group_size, device=prompt_ids.device),
        version=torch.full((len(prompts),), version, dtype=torch.long),
        prompt_index=torch.tensor([p.index for p in prompts], dtype=torch.long),
        behaviour_logp=behaviour_logp, info=info)
    n_completions = len(prompts) * group_size
    size = score_batch or n_completions
    with models.autocast(device, dtype):
        ref_logp = [group_logprobs(ref_model, batch, temperature, completions=slice(s, s + size))
                    for s in range(0, n_completions, size)]                     # [size] each
    batch.ref_logp = torch.cat(ref_logp).view(len(prompts), group_size)       # [B, K]
    return batch, completions


def die_with_parent():
    """Have the kernel kill this process when the trainer dies (Linux). A searcher checks for its
    parent between batches, but a trainer killed while it holds the buffer's or a weight slot's
    lock leaves the searcher waiting on that lock, where no check runs: without this it would
    wait there for ever, an orphan holding its memory."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1                                   # from <linux/prctl.h>
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL))


class Searcher:
    """One searcher: the task, the policy it samples from, the frozen reference and its shard of
    the training prompts. A searcher process (`run`) and a Ray actor (`sources.RaySearchers`)
    each drive one: weights in, scored groups out.

    The reference model is the task's initial model, loaded here, so that it never changes; the
    policy starts from whatever weights the trainer sends first (version 0 at start, or a
    checkpoint's weights on resume), and `start` must be called with that version.
    """

    def __init__(self, rank, cfg, device, threads):
        torch.set_num_threads(threads)
        device = torch.device(device)
        models.use_device(device)
        self.rank, self.cfg = rank, cfg
        self.task = tasks.make_task(cfg)
        self.policy, self.tokenizer = self.task.load_model(device)
        self.ref_model = copy.deepcopy(self.policy).requires_grad_(False)
        self.dtype = getattr(torch, cfg.dtype)
        # Reference scoring in passes no larger than the trainer's (a no-grad pass needs less).
        self.score_batch = cfg.micro_completions or cfg.micro_groups * cfg.group_size
        self.batches = None

    def start(self, version):
        """Seed and pick the prompts, once the first weights (of `version`) are loaded."""
        cfg = self.cfg
        # One seed per (rank, starting version): searchers differ from each other and from the
        # trainer, and a resumed run does not replay the samples of its first session.
        seed = cfg.seed + 1 + self.rank + cfg.searchers * max(version, 0)
        torch.manual_seed(seed)
        train_prompts = self.task.prompts("train", self.tokenizer)
        # Each searcher draws from its own shard; with fewer prompts than searchers, from all.
        shard = (train_prompts[self.rank::cfg.searchers] if len(train_prompts) >= cfg.searchers
                 else train_prompts)
        self.batches = prompt_batches(shard, cfg.prompts_per_step, seed)

    def search(self, version, stop_event=None):
        """One batch of groups from the current weights. -> (prompt ids, GroupBatch on the CPU,
        report: tokens and groups generated, the task's `score` info)"""
        prompts = next(self.batches)
        batch, _ = sample_groups(self.policy, self.ref_model, self.tokenizer, self.task, prompts,
                                 group_size=self.cfg.group_size,
                                 max_new_tokens=self.cfg.max_new_tokens,
                                 temperature=self.cfg.temperature, version=version,
                                 stop_event=stop_event, dtype=self.dtype,
                                 score_batch=self.score_batch)
        batch = batch.to("cpu")
        info, batch.info = batch.info, None
        report = {"rank": self.rank, "tokens": int(batch.response_len.sum()),
                  "groups": len(prompts), "info": info}
        return [p.ids for p in prompts], batch, report


def add_to_buffer(buffer, prompt_ids, batch):
    """Write a searched batch into the replay buffer, one group per prompt."""
    for i, ids in enumerate(prompt_ids):
        buffer.add(ids, batch.response_ids[i], batch.response_len[i], batch.reward[i],
                   batch.ref_logp[i], batch.behaviour_logp[i], int(batch.version[i]),
                   int(batch.prompt_index[i]))


def run(rank, cfg, device, threads, buffer, weights, reports, stop):
    """One searcher process: load, then search with the newest weights until told to stop.

    Every batch of groups goes to the shared buffer and its report to the trainer. Any exception
    is reported with its traceback before the process exits.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # Ctrl-C is the trainer's to handle: it stops us
    transformers_logging.disable_progress_bar()     # the trainer's bars are the ones to watch
    die_with_parent()
    parent = multiprocessing.parent_process().pid   # the trainer, even if it is already gone
    try:
        searcher = Searcher(rank, cfg, device, threads)
        version = weights.receive(searcher.policy, rank, -1, block=True)
        searcher.start(version)
        while not stop.is_set() and os.getppid() == parent:   # never outlive the trainer
            version = weights.receive(searcher.policy, rank, version)
            prompt_ids, batch, report = searcher.search(version, stop)
            if stop.is_set():                 # generation was cut short: not a real group
                break
            add_to_buffer(buffer, prompt_ids, batch)
            reports.put(report)
    except BaseException:
        reports.put({"rank": rank, "error": traceback.format_exc()})
        raise


class SearcherError(RuntimeError):
    """A searcher process failed; the message names it and carries its traceback."""


class SearcherPool:
    """Starts N searcher processes (spawn), watches them, collects their reports, stops them."""

    def __init__(self, cfg, devices, threads, buffer, weights):
        ctx = mp.get_context("spawn")
        self.stop = ctx.Event()
        self.reports = ctx.Queue()
        self.processes = [ctx.Process(target=run, name=f"searcher-{rank}", daemon=True,
                                      args=(rank, cfg, devices[rank], threads, buffer, weights,
                                            self.reports, self.stop))
                          for rank in range(cfg.searchers)]
        for p in self.processes:
            p.start()
        self.closing = threading.Event()
        self.trainer_thread = threading.get_ident()
        self.previous_handler = signal.signal(signal.SIGUSR1, self._searcher_died)
        threading.Thread(target=self._watch, name="searcher-watch", daemon=True).start()

    def _watch(self, grace=5.0):
        """A searcher killed while it holds the buffer's or the weights' lock leaves that lock
        held for ever, and the trainer, waiting on it, would never reach `poll`. So when a
        searcher exits and the trainer has not closed the pool within `grace` seconds, this
        thread interrupts the trainer's wait with SIGUSR1."""
        wait_for_any([p.sentinel for p in self.processes])
        if not self.closing.wait(grace):
            signal.pthread_kill(self.trainer_thread, signal.SIGUSR1)

    def _searcher_died(self, signum, frame):
        self.poll()                           # raises SearcherError with the searcher's report
        raise SearcherError("a searcher exited while the run was going on")

    def poll(self):
        """The searchers' reports since the last call; raise SearcherError if one failed or died."""
        reports = []
        while True:
            try:
                report = self.reports.get_nowait()
            except queue.Empty:
                break
            if "error" in report:
                raise SearcherError(f"searcher {report['rank']} failed:\n{report['error']}")
            reports.append(report)
        for rank, p in enumerate(self.processes):
            if not p.is_alive():
                raise SearcherError(f"searcher {rank} (pid {p.pid}) died with exit code "
                                    f"{p.exitcode}")
        return reports

    def close(self, timeout=10.0):
        """Ask every searcher to stop, wait a little, then terminate whatever is left."""
        self.closing.set()
        signal.signal(signal.SIGUSR1, self.previous_handler)
        self.stop.set()
        deadline = time.time() + timeout
        for p in self.processes:
            p.join(max(0.0, deadline - time.time()))
        for p in self.processes:
            if p.is_alive():
                p.kill()
                p.join()
        self.reports.close()
        self.reports.cancel_join_thread()
