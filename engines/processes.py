"""Searcher processes on this machine: start them, watch them, collect their reports, stop them.

Each process runs `searcher.run`: it loads the task and the models, then searches with the newest
published weights into the shared replay buffer until told to stop. The trainer's side of it is
`async_source.SearcherProcesses`.
"""
import queue
import signal
import threading
import time
from multiprocessing.connection import wait as wait_for_any

import torch.multiprocessing as mp

import searcher
from plumbing.errors import SearcherError


class SearcherPool:
    """Starts N searcher processes (spawn), watches them, collects their reports, stops them."""

    def __init__(self, cfg, devices, threads, buffer, weights, options=searcher.SearchOptions()):
        ctx = mp.get_context("spawn")
        self.stop = ctx.Event()
        self.reports = ctx.Queue()
        self.processes = [ctx.Process(target=searcher.run, name=f"searcher-{rank}", daemon=True,
                                      args=(rank, cfg, devices[rank], threads, buffer, weights,
                                            self.reports, self.stop, options))
                          for rank in range(cfg.searchers)]
        for p in self.processes:
            p.start()
        self.closing = threading.Event()
        self.previous_handler = None

    def watch(self):
        """From now until `close`, a searcher's death interrupts the trainer wherever it waits:
        this installs a SIGUSR1 handler in the calling (the trainer's) thread and starts a
        thread that sends it SIGUSR1 (`_watch`)."""
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
                raise SearcherError(f"searcher {report['rank']} failed:"
                                    + (" " if report.get("reason") else "\n") + report["error"])
            reports.append(report)
        for rank, p in enumerate(self.processes):
            if not p.is_alive():
                raise SearcherError(f"searcher {rank} (pid {p.pid}) died with exit code "
                                    f"{p.exitcode}")
        return reports

    def close(self, timeout=10.0):
        """Ask every searcher to stop, wait a little, then terminate whatever is left."""
        self.closing.set()
        if self.previous_handler is not None:
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
