"""--ray ADDRESS: the searchers as Ray actors, anywhere in a cluster.

`connect_ray` joins (or starts) the cluster before anything is written; `RaySearchers` is the
group source: one actor per searcher, each batch back as an object reference into a replay
buffer the trainer keeps, the weights out through Ray's object store.
"""
import logging
import os
import socket
import time
from pathlib import Path

from tqdm.auto import tqdm

import searcher
from engines.async_source import AsyncSource
from plumbing.errors import SearcherError
from devices.weights import copy_weights, shipped_state

REPO = Path(__file__).resolve().parents[1]      # the repository, shipped as working_dir


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
            # is the run's heavy work, though: at nice 15 beside a busy trainer or another job
            # it gets a small share of the CPU. Clusters made with `ray start` take the same
            # variable (see the README).
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

    def __init__(self, rank, cfg, threads, options):
        import ray
        device = "cuda:0" if ray.get_gpu_ids() else "cpu"   # Ray sets CUDA_VISIBLE_DEVICES
        self.searcher = searcher.Searcher(rank, cfg, device, threads, options)
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


class RaySearchers(AsyncSource):
    """--searchers N --ray ADDRESS: one Ray actor per searcher, spread over the cluster's nodes,
    each holding its policy, reference and the task's scorers (and a GPU when the cluster has
    them). The trainer keeps the replay buffer; `in_flight` searches per searcher are queued at
    any time, so a slow trainer is not flooded and a fast one rarely waits. Weights go out as one
    object in Ray's object store, copied once to each node that needs it."""

    in_flight = 2

    def __init__(self, cfg, buffer, threads, interrupt, options):
        import ray
        super().__init__(cfg, buffer, interrupt)
        self.ray, self.threads, self.options = ray, threads, options
        self.actors, self.requests = [], {}            # request reference -> searcher rank

    def connect(self, quiet=False):
        connect_ray(self.cfg.ray, self.cfg.searchers)

    def start(self, policy, version):
        ray = self.ray
        gpus = 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0
        # One CPU each for Ray's bookkeeping; the actor still runs `threads` torch threads.
        actor = ray.remote(RaySearcher).options(num_cpus=1, num_gpus=gpus,
                                                scheduling_strategy="SPREAD", max_restarts=0)
        self.actors = [actor.remote(rank, self.cfg, self.threads, self.options)
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
            self.buffer.add_batch(prompt_ids, batch)
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
