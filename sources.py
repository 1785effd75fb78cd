"""Where the trainer's groups come from: one interface, three engines.

`make_source` builds the one a run's settings ask for, on the devices `placement` gives each
process. The training loop (`tba.train`) asks a *group source* for each step's batch and hands it new
weights every --sync-every steps; it never touches processes, buffers or Ray itself:

    source.start(policy, version)    searchers begin with these weights (version = steps so far)
    source.fill(progress)            wait until the first batch can be drawn
    source.next_batch(version)       -> (GroupBatch of --prompts-per-step groups, row metrics)
    source.publish(policy, version)  new weights for the searchers -> seconds it took
    source.poll()                    take in the searchers' reports; SearcherError if one failed
    source.take_infos()              the task's `score` infos of the groups searched since
    source.tokens, source.groups     generated so far in this session
    source.state_dict(), load_state_dict(state, step)   for checkpoints (the replay buffer is
                                     state["buffer"], checked against the checkpoint's step)
    source.close()                   stop every searcher; nothing is left running

    InProcess          --searchers 0: the trainer samples each batch itself, on-policy
    SearcherProcesses  --searchers N: processes on this machine filling a shared-memory replay
                       buffer, weights through shared-memory slots (`WeightChannel`)
    RaySearchers       --searchers N --ray ADDRESS: Ray actors anywhere in a cluster; each batch
                       comes back as an object reference into a replay buffer the trainer keeps
"""
import copy
import json
import logging
import os
import socket
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from tqdm.auto import tqdm

import checkpoint
import searcher
from buffer import GroupBatch, ReplayBuffer, shared_bytes
from placement import check_shared_memory
from searcher import SearcherError, add_to_buffer
from weights import WeightChannel, copy_weights, probe_logp, shipped_state

REPO = Path(__file__).resolve().parent


class InProcess:
    """--searchers 0: each step samples fresh groups from the trainer's own policy, or, with
    --lag L, from the policy as it was exactly L updates earlier: staleness without replay,
    timing or randomness of processes, so that a lag sweep isolates what staleness alone costs.

    The lag writes the weights of each version to RUN/lag/ and samples with a separate model
    (`sampler`) loaded from the file of version v − L: one more copy of the weights in memory,
    L + 1 files on disk (SmolLM2-135M: 0.54 GB each, 9.2 GB at L = 16; in memory, 16 copies
    and the trainer's activations would not leave room for a second run on 24 GB). A checkpoint
    records which versions it needs next, and their files stay as long as the checkpoint does
    (--keep-checkpoints), so a run resumed from any kept checkpoint samples with the same old
    weights as one that never stopped.

    With --replay-groups n (GFlowNet red-teaming's loop: half fresh, half replayed) the step
    samples B − n groups fresh and trains on them beside n groups drawn from a replay buffer of
    the completions earlier steps sampled (by --priority-temp, within --max-staleness and
    --max-reuse), then stores the fresh ones in it (as --buffer-evict, --dedup, --merge-cosine
    say). Every fresh completion is trained on, once, as in the on-policy loop, then on each
    replay (--max-reuse counts the replays); until earlier steps have stored n groups, all B
    are fresh."""

    fill_target = 0                       # nothing to wait for before the first step

    def __init__(self, cfg, task, policy, ref_model, tokenizer, prompts, buffer=None):
        self.cfg, self.task, self.policy, self.ref_model, self.tokenizer = (
            cfg, task, policy, ref_model, tokenizer)
        self.prompts = searcher.prompt_batches(prompts, 1, cfg.seed)    # one at a time
        self.prompts_used = 0
        self.buffer = buffer                                # --replay-groups: else None
        self.replay_sampler = torch.Generator().manual_seed(cfg.seed)
        self.score_batch = searcher.score_batch(cfg)
        self.tokens = self.groups = 0
        self.infos = []
        self.sampler = copy.deepcopy(policy).requires_grad_(False) if cfg.lag else policy
        self.lag_dir = Path(cfg.out) / "lag"
        self.sampler_version = None       # the version of the weights the sampler holds (--lag)
        self.next_version = 0             # the version the next step starts from
        self.pins = []                    # the oldest version each kept checkpoint needs

    def start(self, policy, version):
        pass

    def fill(self, progress=None):
        pass

    def weights_file(self, version):
        return self.lag_dir / f"version_{version}.pt"

    def save_weights(self, version):
        """--lag: the policy's weights now, as RUN/lag/version_<version>.pt."""
        self.lag_dir.mkdir(parents=True, exist_ok=True)
        weights = {k: v.detach().cpu() for k, v in shipped_state(self.policy).items()}
        checkpoint.write_file(self.weights_file(version), lambda f: torch.save(weights, f))

    def load_sampler(self, version):
        """--lag: the sampler gets the weights saved as `version` (unless it holds them)."""
        if version != self.sampler_version:
            copy_weights(self.sampler, torch.load(self.weights_file(version), mmap=True,
                                                  weights_only=True))
            self.sampler_version = version

    def delete_weights_before(self, version):
        """--lag: the saved weights older than `version`, which no step or checkpoint needs."""
        for old in self.lag_dir.glob("version_*.pt"):
            if int(old.stem.split("_")[1]) < version:
                old.unlink()

    def next_batch(self, version):
        t0 = time.time()
        self.next_version, sampled = version + 1, version
        if self.cfg.lag:                  # sample from the weights of L updates ago
            self.save_weights(version)
            sampled = max(version - self.cfg.lag, 0)
            self.load_sampler(sampled)
            self.delete_weights_before(min([sampled, *self.pins]))
        cfg = self.cfg
        replayed = self.replay(version)                   # n groups of earlier steps, or None
        n_fresh = cfg.prompts_per_step - (0 if replayed is None else cfg.replay_groups)
        prompts = [next(self.prompts)[0] for _ in range(n_fresh)]
        self.prompts_used += len(prompts)
        batch, _ = searcher.sample_groups(
            self.sampler, self.ref_model, self.tokenizer, self.task, prompts,
            group_size=cfg.group_size, max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature, version=sampled, dtype=getattr(torch, cfg.dtype),
            score_batch=self.score_batch, search_temperature=cfg.search_temperature,
            reference_frac=cfg.reference_frac)
        self.tokens += int(batch.response_len.sum())
        self.groups += len(prompts)
        self.infos = [batch.info] if batch.info is not None else []
        metrics = {"trainer_wait_s": 0.0, "search_s": round(time.time() - t0, 4),
                   "reuse_mean": 1.0, "buffer_completions": 0, "recent_frac_actual": 1.0}
        if self.buffer is not None:
            add_to_buffer(self.buffer, [p.ids for p in prompts], batch.to("cpu"))
            batch.recent_count = len(prompts)                 # the fresh groups
            if replayed is not None:      # trained once fresh, outside the buffer's count
                replayed.draws = replayed.draws + 1               # [n, K] times trained
            batch = GroupBatch.cat([batch] if replayed is None else [batch, replayed],
                                   pad_id=self.tokenizer.pad_token_id)
            metrics.update(reuse_mean=batch.draws[batch.kept()].float().mean().item(),
                           buffer_completions=len(self.buffer),
                           recent_frac_actual=len(prompts) / cfg.prompts_per_step)
        return batch, {**metrics, **searcher.sampling_metrics(batch, version)}

    def replay(self, version):
        """--replay-groups n: n groups drawn from the completions earlier steps stored (by
        --priority-temp; none older than --max-staleness or drawn --max-reuse times), or None
        while the buffer holds fewer than n such groups (or there is no buffer)."""
        cfg = self.cfg
        min_version = version - cfg.max_staleness if cfg.max_staleness >= 0 else -1
        if self.buffer is None or self.buffer.count(min_version, cfg.max_reuse) < cfg.replay_groups:
            return None
        return self.buffer.sample(cfg.replay_groups, recent_frac=0.0,
                                  priority_temp=cfg.priority_temp or None,
                                  generator=self.replay_sampler, min_version=min_version,
                                  max_reuse=cfg.max_reuse)

    def publish(self, policy, version):
        return {"sync_s": 0.0}            # the searcher *is* the trainer's policy

    def poll(self, wait_s=0.0):
        pass

    def take_infos(self):
        infos, self.infos = self.infos, []
        return infos

    def state_dict(self):
        # Called for a checkpoint: --lag's files from its next sampled version on must stay
        # while it is kept (the checkpoints older than the newest --keep-checkpoints are deleted).
        self.pins.append(max(self.next_version - self.cfg.lag, 0))
        if self.cfg.keep_checkpoints:
            self.pins = self.pins[-self.cfg.keep_checkpoints:]
        state = {"prompts_used": self.prompts_used, "lag_pins": list(self.pins)}
        if self.buffer is not None:
            state.update(buffer=self.buffer.state_dict(),
                         sampler=self.replay_sampler.get_state())
        return state

    def load_state_dict(self, state, step):
        # The prompts an earlier synchronous session has seen (none if it ran searchers; a
        # checkpoint from before --replay-groups counted batches of B).
        self.prompts_used = state.get("prompts_used",
                                      state.get("batches_used", 0) * self.cfg.prompts_per_step)
        for _ in range(self.prompts_used):
            next(self.prompts)
        if self.buffer is not None and "buffer" in state:
            self.buffer.load_state_dict(state["buffer"], max_version=step)
            self.replay_sampler.set_state(state["sampler"])
        self.next_version = step
        self.pins = state.get("lag_pins", [max(step - self.cfg.lag, 0)])
        if self.cfg.lag:
            missing = [v for v in range(max(step - self.cfg.lag, 0), step)
                       if not self.weights_file(v).is_file()]
            if missing:
                raise ValueError(f"{self.lag_dir} lacks the weights of version {missing[0]} that "
                                 f"--lag {self.cfg.lag} samples with after step {step}: they "
                                 "were deleted; start the run again")

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
        self.loads = []                   # the searchers' weight loads since the last batch

    def take_reports(self, reports):
        for report in reports:
            if "loaded" in report:        # a weight load (SearcherProcesses), not a search
                self.loads.append(report)
                continue
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
                       "reuse_mean": batch.draws[batch.keep].float().mean().item(),
                       "buffer_completions": len(self.buffer),
                       "recent_frac_actual": batch.recent_count / len(batch.prompt_index),
                       **searcher.sampling_metrics(batch, version), **self.load_metrics()}

    def load_metrics(self):
        """What the searchers report of their weight loads: nothing here (Ray's do not)."""
        return {}

    def state_dict(self):
        return {"buffer": self.buffer.state_dict(), "sampler": self.sampler.get_state()}

    def load_state_dict(self, state, step):
        """The buffer's groups (checked: none may come from a version after `step`) and the
        sampler's random state; an earlier synchronous session left neither."""
        if "buffer" in state:
            self.buffer.load_state_dict(state["buffer"], max_version=step)
        if "sampler" in state:
            self.sampler.set_state(state["sampler"])


class SearcherProcesses(Replay):
    """--searchers N on this machine: spawned processes (searcher.SearcherPool) write to the
    shared-memory buffer and read weights from shared-memory slots."""

    def __init__(self, cfg, buffer, layout, interrupt, shared_bytes=0):
        super().__init__(cfg, buffer, interrupt)
        self.layout = layout
        self.weights = self.pool = None
        self.probes = {}                  # version -> the trainer's `probe_logp` of it
        self.shared_bytes = shared_bytes  # /dev/shm taken by the weight slots and the buffer
        self.loads_file = Path(cfg.out) / "weights.jsonl"

    def start(self, policy, version):
        self.weights = WeightChannel(policy, self.cfg.searchers, mp.get_context("spawn"),
                                     device=self.layout.device)
        self.publish(policy, version)
        self.pool = searcher.SearcherPool(self.cfg, self.layout.searcher_devices,
                                          self.layout.threads, self.buffer, self.weights)

    def publish(self, policy, version):
        t0 = time.time()
        legs = self.weights.publish(policy, version)
        sync_s = time.time() - t0
        self.probes[version] = probe_logp(policy, getattr(torch, self.cfg.dtype))
        self.probes = dict(list(self.probes.items())[-8:])     # loads are never 8 syncs behind
        return {"sync_s": round(sync_s, 4), **{k: round(v, 4) for k, v in legs.items()}}

    def load_metrics(self):
        """The searchers' weight loads since the last batch: the slowest load, and how far the
        probe's log-prob under a searcher's new weights was from the trainer's
        (`weights.probe_logp`; 0 when every load arrived whole, or none came). -> dict"""
        loads, self.loads = self.loads, []
        diffs = [abs(r["probe"] - r["trainer_probe"]) for r in loads if "trainer_probe" in r]
        return {"searcher_load_s": round(max([r["load_s"] for r in loads], default=0.0), 4),
                "sync_probe_diff_max": max(diffs, default=0.0)}

    def poll(self, wait_s=0.0):
        reports = self.pool.poll()
        loads = [r for r in reports if "loaded" in r]
        for r in loads:
            if r["loaded"] in self.probes:
                r["trainer_probe"] = self.probes[r["loaded"]]
        if loads:                         # RUN/weights.jsonl: every load of every searcher
            checkpoint.append_lines(self.loads_file, [json.dumps(r) + "\n" for r in loads])
        self.take_reports(reports)
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
        device = "cuda:0" if ray.get_gpu_ids() else "cpu"   # Ray sets CUDA_VISIBLE_DEVICES
        self.searcher = searcher.Searcher(rank, cfg, device, threads)
        self.version = None

    def set_weights(self, state, version):
        copy_weights(self.searcher.policy, state)
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
        state = {k: v.detach().to("cpu") for k, v in shipped_state(policy).items()}
        state_ref = self.ray.put(state)
        for a in self.actors:
            a.set_weights.remote(state_ref, version)
        return {"sync_s": round(time.time() - t0, 4)}

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


def make_source(cfg, *, task, policy, ref_model, tokenizer, prompts, layout, interrupt):
    """The group source for this run's settings. Searchers (and --replay-groups) get a replay
    buffer sized for the longest prompt (in shared memory unless they are Ray actors);
    `interrupt` raises KeyboardInterrupt when a stop was requested, while the trainer waits for
    groups."""
    if not cfg.searchers and not cfg.replay_groups:
        return InProcess(cfg, task, policy, ref_model, tokenizer, prompts)
    longest = max(len(p.ids) for p in prompts)
    n_prompts = max(p.index for p in prompts) + 1
    embedding_dim = task.embedding_dim if cfg.merge_cosine else 0
    need = ((WeightChannel.bytes_needed(policy) if cfg.searchers and not cfg.ray else 0)
            + shared_bytes(cfg.buffer_capacity, longest, cfg.max_new_tokens, n_prompts,
                           embedding_dim))
    check_shared_memory(need)
    buffer = ReplayBuffer(cfg.buffer_capacity, cfg.group_size, longest, cfg.max_new_tokens,
                          n_prompts=n_prompts, pad_id=tokenizer.pad_token_id,
                          per_prompt=cfg.buffer_per_prompt, evict=cfg.buffer_evict,
                          dedup=cfg.dedup, merge_cosine=cfg.merge_cosine,
                          embedding_dim=embedding_dim)
    if not cfg.searchers:
        return InProcess(cfg, task, policy, ref_model, tokenizer, prompts, buffer=buffer)
    if cfg.ray:
        return RaySearchers(cfg, buffer, layout.threads, interrupt)
    return SearcherProcesses(cfg, buffer, layout, interrupt, shared_bytes=need)
