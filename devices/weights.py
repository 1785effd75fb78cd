"""The trainer's weights on their way to the searchers, and a check that they arrived.

    trainer GPU ──(1)──▶ pinned staging ──(2)──▶ shared slot ──(3)──▶ searcher's staging ──(4)──▶ searcher GPU
                          (the trainer's)         (/dev/shm)           (the searcher's, pinned)

(1) is one DMA per tensor into page-locked memory that only the trainer owns; (2) is the one
host copy of a publish, under the slot's lock; (3) a searcher copies the slot out under the
same lock, host to host, and (4) moves it to its GPU after letting go of the lock, so a
trainer publishing into that slot next waits for a memcpy at most, never for a searcher's GPU.
On a CPU there is no staging: the trainer copies its weights into the slot and a searcher
copies the slot into its model. Each load is checked (`sync_check.py`).
"""
import queue
import time

import torch



class WeightChannel:
    """Ships the trainer's weights to the searchers: shared memory for the bytes, queues for the news.

    Two shared-memory copies of the parameters are allocated once (so shared memory does not grow
    from sync to sync), each with its own lock. Publishes alternate between the slots (by count,
    not by version: versions are multiples of --sync-every, so `version % 2` would put every
    publish in slot 0 when k is even) and each searcher's queue gets a note (version, slot). A
    searcher copies the slot out under the same lock and takes the version stored *in the slot*,
    so it never loads a half-written state dict and never mislabels one. With two slots, the
    trainer only waits if a searcher is still reading the weights from two syncs ago.

    `device`: the trainer's (default: the model's). On a GPU, publishes go through pinned
    staging memory that is made on the first publish and never leaves the trainer's process
    (`__getstate__`).
    """

    def __init__(self, model, n_readers, ctx, device=None):
        state = shipped_state(model)
        self.names = list(state)
        self.slots = [{k: torch.empty_like(v, device="cpu").share_memory_() for k, v in state.items()}
                      for _ in range(2)]
        self.slot_version = torch.full((2,), -1, dtype=torch.long).share_memory_()   # [2]
        self.locks = [ctx.Lock() for _ in range(2)]
        self.queues = [ctx.Queue() for _ in range(n_readers)]
        self.device = torch.device(device or next(model.parameters()).device)
        self.publishes = 0                          # trainer side only: which slot is next
        self.staging = None                         # the process's own pinned copies (GPU only)

    def __getstate__(self):
        """What a spawned searcher receives: the slots, locks and queues, not this process's
        staging. A CPU tensor sent to a spawned process is moved to shared memory in place: the
        trainer's staging would stop being pinned and be a third copy of the weights in /dev/shm."""
        return {**self.__dict__, "staging": None}

    @staticmethod
    def bytes_needed(model):
        """Shared memory of the two slots."""
        return 2 * sum(v.numel() * v.element_size() for v in shipped_state(model).values())

    def pinned_staging(self, state):
        if self.staging is None:
            self.staging = {name: torch.empty_like(state[name], device="cpu").pin_memory()
                            for name in self.names}
        return self.staging

    @torch.no_grad()
    def publish(self, model, version):
        """Trainer side: copy the weights into the free slot, then tell every searcher.
        -> seconds of each leg: to host memory (GPU only) and into the slot, its lock's wait
        included"""
        slot = self.publishes % 2
        self.publishes += 1
        state = model.state_dict()
        start = time.perf_counter()
        if self.device.type == "cuda":
            staging = self.pinned_staging(state)
            for name in self.names:
                staging[name].copy_(state[name], non_blocking=True)
            torch.cuda.synchronize(self.device)     # the DMAs are done: the staging is whole
            state = staging
        to_host = time.perf_counter()
        with self.locks[slot]:
            for name in self.names:
                self.slots[slot][name].copy_(state[name])
            self.slot_version[slot] = version
        for note_queue in self.queues:
            note_queue.put((version, slot))
        return {"sync_to_host_s": to_host - start, "sync_to_slot_s": time.perf_counter() - to_host}

    def close(self):
        """Trainer side, at shutdown: unread notes are dropped instead of blocking the exit."""
        for note_queue in self.queues:
            note_queue.close()
            note_queue.cancel_join_thread()

    @torch.no_grad()
    def receive(self, model, reader, current_version, block=False):
        """Searcher side: load the newest published weights if newer than ours. -> version"""
        note = None
        try:
            note = self.queues[reader].get(block=block)
            while True:                             # skip to the newest note
                note = self.queues[reader].get_nowait()
        except queue.Empty:
            pass
        if note is None:
            return current_version
        slot = note[1]
        on_gpu = next(model.parameters()).is_cuda
        with self.locks[slot]:
            version = int(self.slot_version[slot])
            if version <= current_version:
                return current_version
            if on_gpu:                              # out of the slot quickly: host to host
                staging = self.pinned_staging(self.slots[slot])
                for name in self.names:
                    staging[name].copy_(self.slots[slot][name])
            else:
                copy_weights(model, self.slots[slot])
        if on_gpu:                                  # the slot is free again: now to the GPU
            copy_weights(model, staging, non_blocking=True)
            torch.cuda.synchronize(next(model.parameters()).device)
        return version


def shipped_state(model):
    """The weights that train, by their state-dict names: every parameter, or a LoRA adapter's
    only (the frozen weights a searcher loads itself and never changes). Tied weights
    (embedding = output layer) appear under two names but are shipped once."""
    seen, trained = set(), {p.data_ptr() for p in model.parameters() if p.requires_grad}
    return {k: v for k, v in model.state_dict().items()
            if v.data_ptr() in trained and v.data_ptr() not in seen and not seen.add(v.data_ptr())}


@torch.no_grad()
def copy_weights(model, state, non_blocking=False):
    """Copy a `shipped_state` into the model's own tensors, in place (tied ones are set once)."""
    own = model.state_dict()
    for name, value in state.items():
        own[name].copy_(value, non_blocking=non_blocking)
