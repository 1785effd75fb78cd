"""The searcher: turn prompts into scored groups of completions.

`sample_groups` is one unit of search: K completions for each of B prompts from the current
policy, their rewards from the task, and their log-probs under the frozen reference model. The
synchronous loop calls it in the trainer's process; asynchronous searchers (`run`, started and
watched by `SearcherPool`) call it in a loop in their own processes and write the groups to the
replay buffer. Where the groups go from there is `sources.py`'s concern.
"""
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
import placement
import tasks
from buffer import REFERENCE, GroupBatch
from trainer import group_logprobs
from weights import probe_logp


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


def exploration(n_groups, temperature, search_temperature=None, reference_frac=0.0):
    """How each of n groups is sampled: its temperature, U(LOW, HIGH) per group with
    `search_temperature` = (LOW, HIGH), else `temperature`; and whether the frozen reference
    samples it instead of the policy, with probability `reference_frac`. Random draws happen
    only for what is asked, so a run without exploration samples exactly as before.
    -> temperatures [n] float32, from_reference [n] bool"""
    if search_temperature:
        low, high = search_temperature
        temperatures = low + (high - low) * torch.rand(n_groups)                 # [n]
    else:
        temperatures = torch.full((n_groups,), float(temperature))               # [n]
    from_reference = (torch.rand(n_groups) < reference_frac if reference_frac
                      else torch.zeros(n_groups, dtype=torch.bool))              # [n]
    return temperatures, from_reference


@torch.no_grad()
def sample_groups(policy, ref_model, tokenizer, task, prompts, group_size, max_new_tokens,
                  temperature, version=0, stop_event=None, dtype=torch.float32, score_batch=0,
                  search_temperature=None, reference_frac=0.0):
    """Generate, score and reference-score one batch of groups.  -> (GroupBatch, completions)

    The batch carries the behaviour log-probs log μ(y|x) of the distribution that sampled it
    (taken during generation): what importance weights and the staleness metrics of
    `trainer.train_step` need, however old the group is when it is trained on.
    Exploration (`exploration`): each group may be sampled at its own temperature drawn from
    `search_temperature` = (LOW, HIGH), and by the reference model with probability
    `reference_frac`; the batch records both per group. Rewards and reference log-probs do not
    depend on how a group was sampled: the reference scores at `temperature`, the trainer's.
    Generation and reference scoring run under the trainer's autocast `dtype`; the reference
    scores `score_batch` sequences per forward pass (0: all B·K at once).
    """
    device = next(policy.parameters()).device
    temperatures, from_reference = exploration(len(prompts), temperature, search_temperature,
                                               reference_frac)                   # [B], [B]
    parts, order = [], []                # one `generate` call per sampler, then back in order
    for sampler, rows in ((policy, ~from_reference), (ref_model, from_reference)):
        if rows.any():
            with models.autocast(device, dtype):
                parts.append(models.generate(
                    sampler, tokenizer, [p.ids for p, r in zip(prompts, rows) if r],
                    num_samples=group_size, max_new_tokens=max_new_tokens,
                    temperature=temperatures[rows] if search_temperature else temperature,
                    stop_event=stop_event, with_logprobs=True))
            order.append(rows.nonzero().flatten())
    prompt_ids, prompt_mask, response_ids, response_len, behaviour_logp = (
        parts[0] if len(parts) == 1 else models.concat_generations(
            parts, order=torch.cat(order), pad_id=tokenizer.pad_token_id))
    completions = models.decode(tokenizer, response_ids, response_len)       # B·K strings
    repeated = [p for p in prompts for _ in range(group_size)]
    reward, info = task.score(repeated, completions)
    reward = torch.tensor(reward, dtype=torch.float32)
    per_completion = (len(prompts), group_size)                                # [B, K]
    on = prompt_ids.device               # every tensor of the batch where the model is
    batch = GroupBatch(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
        response_len=response_len, reward=reward.view(per_completion).to(on),
        ref_logp=torch.zeros(per_completion, device=on),
        version=torch.where(from_reference, REFERENCE, version).long()[:, None].expand(per_completion).to(on),
        prompt_index=torch.tensor([p.index for p in prompts], dtype=torch.long, device=on),
        behaviour_logp=behaviour_logp,
        search_temperature=temperatures[:, None].expand(per_completion).to(on),
        from_reference=from_reference[:, None].expand(per_completion).to(on), info=info)
    if isinstance(info, dict) and "embeddings" in info:   # for the buffer's near-duplicate merge
        batch.embedding = torch.as_tensor(info["embeddings"]).view(len(prompts), group_size, -1)
    n_completions = len(prompts) * group_size
    size = score_batch or n_completions
    with models.autocast(device, dtype):
        ref_logp = [group_logprobs(ref_model, batch, temperature, completions=slice(s, s + size))
                    for s in range(0, n_completions, size)]                     # [size] each
    batch.ref_logp = torch.cat(ref_logp).view(len(prompts), group_size)       # [B, K]
    return batch, completions


def score_batch(cfg):
    """Completions per no-grad pass of the reference: the trainer's micro-batch (0: all B·K at
    once), but at least a whole group. A no-grad pass keeps no activations for backward, so a
    gradient pass's --micro-completions would only split it into many small passes (the paper
    recipe's 140 completions would take 35 passes of 4, not 7 of 20)."""
    if cfg.micro_completions:
        return max(cfg.micro_completions, cfg.group_size)
    return cfg.micro_groups * cfg.group_size


def sampling_metrics(batch, version):
    """How the completions of a step were sampled, counting only those trained on: how many
    updates behind `version` (the trainer's) the policy's own samples are, the share the
    reference sampled (of no version: never stale), and their mean temperature.  -> dict"""
    kept = batch.kept()                                                        # [B, K]
    metrics = {"trained_completions": int(kept.sum())}
    by_policy = kept & (batch.version != REFERENCE)                            # [B, K]
    if by_policy.any():
        staleness = (version - batch.version[by_policy]).float()               # [n]
        metrics.update(staleness_mean=staleness.mean().item(),
                       staleness_max=staleness.max().item())
    if batch.from_reference is not None:
        metrics["from_reference_frac"] = batch.from_reference[kept].float().mean().item()
    if batch.search_temperature is not None and not batch.search_temperature[kept].isnan().all():
        metrics["search_temperature_mean"] = batch.search_temperature[kept].nanmean().item()
    return metrics


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
        self.placed = str(device)         # as placement gave it (cuda:1); `device`: its tensors'
        device = placement.set_up_process(device, threads)
        self.rank, self.cfg = rank, cfg
        self.task = tasks.make_task(cfg)
        self.policy, self.tokenizer = self.task.load_model(device)
        self.dtype = getattr(torch, cfg.dtype)
        self.ref_model = models.frozen_copy(self.policy, self.dtype)
        self.score_batch = score_batch(cfg)
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
                                 score_batch=self.score_batch,
                                 search_temperature=self.cfg.search_temperature,
                                 reference_frac=self.cfg.reference_frac)
        batch = batch.to("cpu")
        info, batch.info = batch.info, None
        report = {"rank": self.rank, "tokens": int(batch.response_len.sum()),
                  "groups": len(prompts), "info": info}
        return [p.ids for p in prompts], batch, report


def add_to_buffer(buffer, prompt_ids, batch):
    """Write a searched batch's completions into the replay buffer, prompt by prompt."""
    for i, ids in enumerate(prompt_ids):
        buffer.add(ids, batch.response_ids[i], batch.response_len[i], batch.reward[i],
                   batch.ref_logp[i], batch.behaviour_logp[i], batch.version[i],
                   int(batch.prompt_index[i]), search_temperature=batch.search_temperature[i],
                   embedding=None if batch.embedding is None else batch.embedding[i])


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
        version = receive_weights(searcher, weights, -1, reports, block=True)
        searcher.start(version)
        while not stop.is_set() and os.getppid() == parent:   # never outlive the trainer
            version = receive_weights(searcher, weights, version, reports)
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
