"""Where the trainer's groups come from: one interface, three engines.

The training loop (`tba.train`) asks a *group source* for each step's batch and hands it new
weights every --sync-every steps; it never touches processes, buffers or Ray itself:

    source.start(policy, version)    searchers begin with these weights (version = steps so far)
    source.fill(progress)            wait until the first batch can be drawn
    source.next_batch(version)       -> (GroupBatch of --prompts-per-step groups, row metrics)
    source.publish(policy, version)  new weights for the searchers -> seconds it took
    source.poll()                    take in the searchers' reports; SearcherError if one failed
    source.take_infos()              the task's `score` infos of the groups searched since
    source.tokens, source.groups     generated so far in this session
    source.state_dict(), load_state_dict(state)   for checkpoints ("buffer" goes to buffer.pt)
    source.close()                   stop every searcher; nothing is left running

    InProcess          --searchers 0: the trainer samples each batch itself, on-policy
    SearcherProcesses  --searchers N: processes on this machine filling a shared-memory replay
                       buffer, weights through shared-memory slots (trainer.WeightChannel)
    RaySearchers       --searchers N --ray ADDRESS: Ray actors anywhere in a cluster; each batch
                       comes back as an object reference into a replay buffer the trainer keeps
"""
import logging
import os
import socket
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from tqdm.auto import tqdm

import searcher
import trainer
from searcher import SearcherError, add_to_buffer

REPO = Path(__file__).resolve().parent


class InProcess:
    """--searchers 0: each step samples fresh groups from the trainer's own policy."""

    fill_target = 0                       # nothing to wait for before the first step

    def __init__(self, cfg, task, policy, ref_model, tokenizer, prompts):
        self.cfg, self.task, self.policy, self.ref_model, self.tokenizer = (
            cfg, task, policy, ref_model, tokenizer)
        self.batches = searcher.prompt_batches(prompts, cfg.prompts_per_step, cfg.seed)
        self.batches_used = 0
        self.score_batch = cfg.micro_completions or cfg.micro_groups * cfg.group_size
        self.tokens = self.groups = 0
        self.infos = []

    def start(self, policy, version):
        pass

    def fill(self, progress=None):
        pass

    def next_batch(self, version):
        t0 = time.time()
        batch, _ = searcher.sample_groups(
            self.policy, self.ref_model, self.tokenizer, self.task, next(self.batches),
            self.cfg.group_size, self.cfg.max_new_tokens, self.cfg.temperature, version,
            dtype=getattr(torch, self.cfg.dtype), score_batch=self.score_batch)
        self.batches_used += 1
        self.tokens += int(batch.response_len.sum())
        self.groups += len(batch.version)
        self.infos = [batch.info] if batch.info is not None else []
        return batch, {"trainer_wait_s": 0.0, "search_s": round(time.time() - t0, 4),
                       "reuse_mean": 1.0, "buffer_groups": 0, "recent_frac_actual": 1.0}

    def publish(self, policy, version):
        return 0.0                        # the searcher *is* the trainer's policy

    def poll(self, wait_s=0.0):
        pass

    def take_infos(self):
        infos, self.infos = self.infos, []
        return infos

    def state_dict(self):
        return {"batches_used": self.batches_used}

    def load_state_dict(self, state):
        # The prompts an earlier synchronous session has seen (none if it ran searchers).
        self.batches_used = state.get("batches_used", 0)
        for _ in range(self.batches_used):
            next(self.batches)

    def close(self):
        pass


class Replay:
    """What the asynchronous sources share: searchers elsewhere fill a replay buffer, and each
    step draws from it by the rules of `ReplayBuffer.sample` (m, priority, staleness, reuse).
    Subclasses start the searchers, ship weights and collect reports in `poll`."""

    def __init__(self, cfg, buffer, interrupt):
        self.cfg, self.buffer = cfg, buffer
        self.interrupt = interrupt        # raises KeyboardInterrupt when a stop was requested
        self.sampler = torch.Generator().manual_seed(cfg.seed)
        self.fill_target = max(cfg.min_buffer, cfg.prompts_per_step)
        self.tokens = self.groups = 0
        self.infos = []

    def take_reports(self, reports):
        for report in reports:
            self.tokens += report["tokens"]
            self.groups += report["groups"]
            if report["info"] is not None:
                self.infos.append(report["info"])

    def take_infos(self):
        infos, self.infos = self.infos, []
        return infos

    def wait_for(self, n_groups, min_version=-1, max_reuse=0, progress=None):
        """Block until the buffer holds n_groups fresh enough, and used few enough times, to
        train on. -> seconds waited"""
        start = time.time()
        while (have := self.buffer.count(min_version, max_reuse)) < n_groups:
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
                                   self.sampler, min_version, cfg.max_reuse)
        return batch, {"trainer_wait_s": round(wait_s, 4), "search_s": 0.0,
                       "reuse_mean": batch.draws.float().mean().item(),
                       "buffer_groups": len(self.buffer),
                       "recent_frac_actual": batch.recent_count / len(batch.version)}

    def state_dict(self):
        return {"buffer": self.buffer.state_dict(), "sampler": self.sampler.get_state()}

    def load_state_dict(self, state):
        # The buffer was restored (and checked) by `tba.load`; an earlier synchronous session
        # left no sampler state.
        if "sampler" in state:
            self.sampler.set_state(state["sampler"])


class SearcherProcesses(Replay):
    """--searchers N on this machine: spawned processes (searcher.SearcherPool) write to the
    shared-memory buffer and read weights from shared-memory slots."""

    def __init__(self, cfg, buffer, devices, threads, interrupt):
        super().__init__(cfg, buffer, interrupt)
        self.devices, self.threads = devices, threads
        self.weights = self.pool = None

    def start(self, policy, version):
        self.weights = trainer.WeightChannel(policy, self.cfg.searchers, mp.get_context("spawn"))
        self.weights.publish(policy, version)
        self.pool = searcher.SearcherPool(self.cfg, self.devices, self.threads, self.buffer,
                                          self.weights)

    def publish(self, policy, version):
        t0 = time.time()
        self.weights.publish(policy, version)
        return time.time() - t0

    def poll(self, wait_s=0.0):
        self.take_reports(self.pool.poll())
        time.sleep(wait_s)

    def close(self):
        if self.pool:
            self.pool.close()
        if self.weights:
            self.weights.close()


def first_line(error):
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def connect_ray(address, searchers):
    """Join the Ray cluster at `address` ('auto': the one `ray start` made on this machine), or
    start one on this machine ('local'), and check that it can hold the searchers (else their
    actors would wait for ever). Any failure is a ValueError: bad input, before anything is
    written. Code travels with the job (the repository folder, less run folders); each node
    needs the Python packages."""
    import ray
    runtime_env = {"working_dir": str(REPO), "excludes": ["runs/", "notebooks/"]}
    try:
        if address == "local":
            # Ray starts its workers at nice 15, to keep its own daemons responsive. A searcher
            # is the run's heavy work, though: at nice 15 beside a busy trainer or another job it
            # got a fortieth of the CPU here (0.85 s a toy batch instead of 0.02). Clusters made
            # with `ray start` take the same variable (see the README).
            os.environ.setdefault("RAY_worker_niceness", "0")
            ray.init(num_cpus=os.cpu_count(), include_dashboard=False, runtime_env=runtime_env,
                     logging_level=logging.WARNING)
        else:
            if ":" in address and not address.startswith("ray://"):
                # Ray retries an address where nothing listens for minutes: ask once, quickly.
                host, port = address.rsplit(":", 1)
                with socket.create_connection((host, int(port)), timeout=10):
                    pass
            ray.init(address=address, runtime_env=runtime_env, logging_level=logging.WARNING)
    except Exception as e:
        raise ValueError(f"--ray {address}: cannot join the Ray cluster ({first_line(e)}): "
                         "start one with `ray start --head`, or pass --ray local") from None
    cpus = int(ray.cluster_resources().get("CPU", 0))
    if cpus < searchers:
        ray.shutdown()
        raise ValueError(f"--searchers {searchers}: the Ray cluster at {address} has {cpus} CPU(s), "
                         f"one per searcher is needed: use --searchers {cpus} or add nodes")


class RaySearcher:
    """A Ray actor around one `searcher.Searcher`. Calls from the trainer run one at a time in
    the order sent, so weights sent after two searches are loaded when both are done."""

    def __init__(self, rank, cfg, threads):
        import ray
        device = "cuda" if ray.get_gpu_ids() else "cpu"   # Ray sets CUDA_VISIBLE_DEVICES
        self.searcher = searcher.Searcher(rank, cfg, device, threads)
        self.version = None

    def set_weights(self, state, version):
        trainer.copy_weights(self.searcher.policy, state)
        if self.version is None:
            self.searcher.start(version)
        self.version = version

    def search(self):
        return self.searcher.search(self.version)

    def node(self):
        import ray
        return ray.get_runtime_context().get_node_id()


class RaySearchers(Replay):
    """--searchers N --ray ADDRESS: one Ray actor per searcher, spread over the cluster's nodes,
    each holding its policy, reference and the task's scorers (and a GPU when the cluster has
    them). The trainer keeps the replay buffer; `in_flight` searches per searcher are queued at
    any time, so a slow trainer is not flooded and a fast one rarely waits. Weights go out as one
    object in Ray's object store, copied once to each node that needs it."""

    in_flight = 2

    def __init__(self, cfg, buffer, threads, interrupt):
        import ray
        super().__init__(cfg, buffer, interrupt)
        self.ray, self.threads = ray, threads
        self.actors, self.requests = [], {}            # request reference -> searcher rank

    def start(self, policy, version):
        ray = self.ray
        gpus = 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0
        # One CPU each for Ray's bookkeeping; the actor still runs `threads` torch threads.
        actor = ray.remote(RaySearcher).options(num_cpus=1, num_gpus=gpus,
                                                scheduling_strategy="SPREAD", max_restarts=0)
        self.actors = [actor.remote(rank, self.cfg, self.threads)
                       for rank in range(self.cfg.searchers)]
        nodes = self.get([a.node.remote() for a in self.actors])      # once they are loaded
        tqdm.write(f"{len(self.actors)} Ray searcher(s) on {len(set(nodes))} node(s)")
        self.publish(policy, version)
        for rank, a in enumerate(self.actors):
            for _ in range(self.in_flight):
                self.requests[a.search.remote()] = rank

    def publish(self, policy, version):
        t0 = time.time()
        state = {k: v.detach().to("cpu") for k, v in trainer.WeightChannel.shipped_state(policy).items()}
        state_ref = self.ray.put(state)
        for a in self.actors:
            a.set_weights.remote(state_ref, version)
        return time.time() - t0

    def poll(self, wait_s=0.0):
        ray = self.ray
        done, _ = ray.wait(list(self.requests), num_returns=len(self.requests), timeout=wait_s)
        for request in done:
            rank = self.requests.pop(request)
            prompt_ids, batch, report = self.get(request, rank)
            add_to_buffer(self.buffer, prompt_ids, batch)
            self.take_reports([report])
            self.requests[self.actors[rank].search.remote()] = rank

    def get(self, request, rank=None):
        """ray.get, with a searcher's failure turned into a SearcherError that names it."""
        ray, who = self.ray, "a searcher" if rank is None else f"searcher {rank}"
        try:
            return ray.get(request)
        except ray.exceptions.ActorDiedError as e:
            raise SearcherError(f"{who} (a Ray actor) died: {first_line(e)}") from None
        except ray.exceptions.RayError as e:
            raise SearcherError(f"{who} (a Ray actor) failed:\n{e}") from None

    def close(self):
        for a in self.actors:
            self.ray.kill(a)
        self.actors, self.requests = [], {}
        self.ray.shutdown()               # a cluster this run started stops; another one stays


def make_source(cfg, setup, interrupt):
    """The group source for this run's settings; `setup` comes from `tba.load`."""
    if not cfg.searchers:
        return InProcess(cfg, setup.task, setup.policy, setup.ref_model, setup.tokenizer,
                         setup.prompts)
    if cfg.ray:
        return RaySearchers(cfg, setup.buffer, setup.threads, interrupt)
    return SearcherProcesses(cfg, setup.buffer, setup.searcher_devices, setup.threads, interrupt)
