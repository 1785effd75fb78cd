"""Replay buffer of completions, shared between processes; groups are formed when drawn.

`add_batch` stores each searched completion in a slot of its own, beside the other completions of
its prompt (what is kept, and what makes way: replay/storage.py). `sample` forms each trained group
when drawn: a prompt, then up to K of its completions, with probability m among the newest weights'
(recency), else by reward or uniformly (replay/draws.py). A group may mix weight versions and
temperatures: each completion carries its own behaviour log-prob and version.

Every field is a fixed-size tensor in shared memory, so a searcher process started with `spawn`
gets handles to the same storage; one lock guards them all, so a reader never sees a
half-written completion and two writers never claim one slot. Layout (C = capacity, N = prompts
of the dataset, P, R = the longest prompt and response, D = embedding_dim): prompts [N, P] left
padded, completions [C, R] right padded, lengths stored (pad and EOS may be the same id). A slot
is empty when its prompt index is -1; the reference's samples have version REFERENCE (-1).
"""
import math
from typing import Optional

import numpy as np
import torch
import torch.multiprocessing as mp

from batch import REFERENCE, GroupBatch
from replay import saved_state
from replay.draws import Pool, draw_without_replacement, groups_in
from replay.storage import Storage


def shared_bytes(capacity, max_prompt_len, max_response_len, n_prompts, embedding_dim=0):
    """Shared memory a ReplayBuffer of this shape takes, to check /dev/shm before making one:
    the prompt table (int32 tokens, a length) and per completion its tokens (int32), reward,
    reference and behaviour log-probs, temperature and embedding (float32), and five int64
    numbers (length, version, prompt index, order, draws)."""
    P, R, D = max_prompt_len, max_response_len, embedding_dim
    return n_prompts * (4 * P + 8) + capacity * (4 * R + 4 * (4 + D) + 5 * 8) + 8


class ReplayBuffer:
    FIELDS = ("prompt_ids", "prompt_len", "response_ids", "response_len", "reward", "ref_logp",
              "behaviour_logp", "embedding", "version", "prompt_index", "order", "draws",
              "search_temperature")

    def __init__(self, capacity: int, group_size: int, max_prompt_len: int,
                 max_response_len: int, n_prompts: int, pad_id: int = 0, per_prompt: int = 0,
                 evict: str = "oldest", dedup: bool = False, merge_cosine: float = 0.0,
                 embedding_dim: int = 0):
        """capacity: completions held in all; per_prompt: at most this many of one prompt
        (0: no bound but the capacity); group_size: K, the most completions a drawn group has."""
        C, K, P, R, N, D = (capacity, group_size, max_prompt_len, max_response_len, n_prompts,
                            embedding_dim)
        if min(C, K, P, R, N) < 1:
            raise ValueError("capacity, group_size, max_prompt_len, max_response_len, n_prompts "
                             "must be >= 1")
        self.capacity, self.group_size, self.n_prompts = C, K, N
        self.max_prompt_len, self.max_response_len, self.pad_id = P, R, pad_id
        self.prompt_ids = torch.full((N, P), pad_id, dtype=torch.int32)       # [N, P]
        self.prompt_len = torch.zeros(N, dtype=torch.int64)                   # [N] 0: not seen
        self.response_ids = torch.full((C, R), pad_id, dtype=torch.int32)     # [C, R]
        self.response_len = torch.zeros(C, dtype=torch.int64)                 # [C]
        self.reward = torch.zeros(C, dtype=torch.float32)                     # [C]
        self.ref_logp = torch.zeros(C, dtype=torch.float32)                   # [C]
        self.behaviour_logp = torch.zeros(C, dtype=torch.float32)             # [C] log μ
        self.embedding = torch.zeros(C, D, dtype=torch.float32)               # [C, D], unit
        self.version = torch.zeros(C, dtype=torch.int64)                      # [C]
        self.prompt_index = torch.full((C,), -1, dtype=torch.int64)           # [C] -1: empty
        self.order = torch.full((C,), -1, dtype=torch.int64)                  # [C] when stored
        self.draws = torch.zeros(C, dtype=torch.int64)                        # [C] times drawn
        self.search_temperature = torch.zeros(C, dtype=torch.float32)         # [C]
        self.n_added = torch.zeros(1, dtype=torch.int64)                      # [1] orders given
        for name in self.FIELDS + ("n_added",):
            getattr(self, name).share_memory_()
        # what is kept and what makes way (replay/storage.py), on these tensors
        self.storage = Storage(self, per_prompt, evict, dedup, merge_cosine)
        # A spawn-context lock pickles into processes started with the spawn method.
        self._lock = mp.get_context("spawn").Lock()

    def __len__(self) -> int:
        """Completions stored."""
        with self._lock:
            return int((self.prompt_index >= 0).sum())

    # Selection runs in NumPy, on views of the shared tensors (`.numpy()` shares their memory):
    # its masks and searches cost less per call than torch's (bench/buffer.py). The weights and
    # random picks of a draw are in replay/draws.py.

    def _available(self, min_version, max_reuse):
        """[C] bool (NumPy): the completions that may be drawn: stored, fresh enough (a
        reference sample is never stale), not used up."""
        index, version = self.prompt_index.numpy(), self.version.numpy()
        available = (index >= 0) & ((version >= min_version) | (version == REFERENCE))   # [C]
        if max_reuse:
            available &= self.draws.numpy() < max_reuse
        return available

    def completions_per_prompt(self, mask):
        """[N] (NumPy) how many of the completions in `mask` [C] each prompt has."""
        return np.bincount(self.prompt_index.numpy()[mask], minlength=self.n_prompts)

    def drawable_groups(self, min_version: int = -1, max_reuse: int = 0) -> int:
        """Number of groups that ``sample`` can draw at least, with the same bounds."""
        with self._lock:
            return groups_in(self.completions_per_prompt(self._available(min_version, max_reuse)),
                             self.group_size)

    # --- store ---------------------------------------------------------------------------------

    def add(self, prompt_ids, response_ids, response_len, reward, ref_logp, behaviour_logp,
            version, prompt_index: int, search_temperature=math.nan, embedding=None) -> int:
        """Store a group's completions: prompt_ids [p] unpadded; response_ids [k, r] right
        padded; response_len, reward, ref_logp, behaviour_logp [k]; version, search_temperature
        [k] or one number; embedding [k, D] (merging only). -> how many were stored"""
        P, R = self.max_prompt_len, self.max_response_len
        prompt = torch.as_tensor(prompt_ids)
        resp = torch.as_tensor(response_ids)
        k = resp.shape[0] if resp.dim() == 2 else -1
        lens = torch.as_tensor(response_len, dtype=torch.int64)

        def each(value, dtype):               # [k]; one number is every completion's
            value = torch.as_tensor(value, dtype=dtype)
            return value.expand(max(k, 0)) if value.dim() == 0 else value
        per_completion = {"reward": each(reward, torch.float32),
                          "ref_logp": each(ref_logp, torch.float32),
                          "behaviour_logp": each(behaviour_logp, torch.float32),
                          "version": each(version, torch.int64),
                          "search_temperature": each(search_temperature, torch.float32)}
        self.storage.check_group(prompt, resp, lens, per_completion, prompt_index, embedding)
        # Build the padded rows outside the lock; only the copy into shared memory is locked.
        p_row = torch.full((P,), self.pad_id, dtype=torch.int32)              # [P]
        p_row[P - prompt.numel():] = prompt
        r_rows = torch.full((k, R), self.pad_id, dtype=torch.int32)           # [k, R]
        r_rows[:, :resp.shape[1]] = resp
        r_rows[torch.arange(R) >= lens[:, None]] = self.pad_id
        if self.storage.merge_cosine:
            embedding = torch.nn.functional.normalize(torch.as_tensor(embedding).float(), dim=-1)
        stored = 0
        with self._lock:
            self.prompt_ids[prompt_index], self.prompt_len[prompt_index] = p_row, prompt.numel()
            # best first: of two near-duplicates in one group, the better one stays
            for i in per_completion["reward"].argsort(descending=True, stable=True).tolist():
                completion = {name: t[i] for name, t in per_completion.items()}
                stored += self.storage.store(prompt_index, r_rows[i], lens[i], completion,
                                                None if embedding is None else embedding[i])
        return stored

    def add_batch(self, prompt_ids, batch: GroupBatch) -> int:
        """Store a searched batch (on the CPU), group by group; `prompt_ids`: each group's
        prompt, unpadded. -> how many completions were stored"""
        return sum(self.add(ids, batch.response_ids[i], batch.response_len[i], batch.reward[i],
                            batch.ref_logp[i], batch.behaviour_logp[i], batch.version[i],
                            int(batch.prompt_index[i]), batch.search_temperature[i],
                            None if batch.embedding is None else batch.embedding[i])
                   for i, ids in enumerate(prompt_ids))

    # --- draw ----------------------------------------------------------------------------------

    def sample(self, n_groups: int, recent_frac: float, priority_temp: Optional[float] = None,
               generator: Optional[torch.Generator] = None, min_version: int = -1,
               max_reuse: int = 0) -> GroupBatch:
        """Draw ``n_groups`` groups of up to K completions, no completion twice. Group by group:
        with probability ``recent_frac`` from the pool of the newest policy version's
        completions, else from all (prompts weighted by `Pool`, completions by `_draw_group`).
        Never drawn: completions older than ``min_version`` (reference samples are of no
        version) and, when ``max_reuse`` > 0, ones already drawn that many times."""
        if not 0.0 <= recent_frac <= 1.0:
            raise ValueError(f"recent_frac must be in [0, 1], got {recent_frac}")
        if priority_temp is not None and priority_temp <= 0:
            raise ValueError(f"priority_temp must be > 0, got {priority_temp}")
        with self._lock:  # held for selection and copy: the chosen completions cannot change
            index, version = self.prompt_index.numpy(), self.version.numpy()   # [C], [C]
            reward = self.reward.numpy()                                       # [C]
            available = self._available(min_version, max_reuse)                # [C]
            # The drawable slots and their prompts, found once: each group then searches these.
            drawable = np.flatnonzero(available)                               # [A]
            drawable_prompt = index[drawable]                                  # [A]
            left = np.bincount(drawable_prompt, minlength=self.n_prompts)      # [N]
            if not 1 <= n_groups <= groups_in(left, self.group_size):
                raise ValueError(f"cannot sample {n_groups} groups from a buffer holding "
                                 f"{groups_in(left, self.group_size)} of version >= "
                                 f"{min_version}"
                                 + (f" drawn fewer than {max_reuse} times" if max_reuse else ""))
            by_policy = (index >= 0) & (version != REFERENCE)                     # [C]
            newest = version[by_policy].max() if by_policy.any() else REFERENCE - 1
            recent_mask = available & (version == newest)                      # [C]
            prompt_reward, log_weight = None, np.zeros(len(drawable))          # [A] uniform
            if priority_temp is not None:
                drawable_reward = reward[drawable].astype(np.float64)          # [A]
                prompt_reward = np.bincount(drawable_prompt, weights=drawable_reward,
                                            minlength=self.n_prompts) / np.maximum(left, 1)
                log_weight = drawable_reward / priority_temp                   # [A]
            everything = Pool(available, left, prompt_reward, priority_temp)
            recent = Pool(recent_mask, self.completions_per_prompt(recent_mask))
            # One draw from the caller's torch generator seeds this sample's NumPy generator:
            # the draws are as reproducible (and resumable) as the torch generator's state, and
            # each costs NumPy's call, not torch's.
            rng = np.random.default_rng(int(torch.randint(2**62, (), generator=generator)))
            groups, recent_count = [], 0
            for _ in range(n_groups):
                from_recent = rng.random() < recent_frac and recent.weight.any()
                pool = recent if from_recent else everything
                prompt = pool.pick_prompt(rng)
                mine = np.flatnonzero(drawable_prompt == prompt)               # [m] of [A]
                groups.append(self._draw_group(prompt, drawable[mine], log_weight[mine], pool,
                                               (everything, recent), rng))
                recent_count += int(from_recent)
            return self._copy_out(groups, recent_count)

    def _draw_group(self, prompt, candidates, log_weight, pool, pools, rng):
        """One group of `prompt` from `pool` (under the lock): up to K of its `candidates` [m]
        still in the pool, drawn by `log_weight` [m] (0: uniformly, else reward / priority_temp);
        they leave every pool of `pools`. -> slots [k] (NumPy)"""
        inside = pool.mask[candidates]                                         # [m]
        candidates, log_weight = candidates[inside], log_weight[inside]        # [n] in the pool
        slots = candidates[draw_without_replacement(log_weight, self.group_size, rng)]  # [k]
        for each in pools:
            each.take(prompt, slots)
        return slots

    def _copy_out(self, groups, recent_count) -> GroupBatch:
        """The drawn groups as a GroupBatch (under the lock, in NumPy); each drawn completion's
        count of draws goes up by one."""
        B, K = len(groups), self.group_size
        idx = np.zeros((B, K), dtype=np.int64)                                 # [B, K] slots
        keep = np.zeros((B, K), dtype=bool)                                    # [B, K]
        for b, slots in enumerate(groups):
            idx[b, :len(slots)], keep[b, :len(slots)] = slots, True
        self.draws.numpy()[idx[keep]] += 1
        prompts = self.prompt_index.numpy()[idx[:, 0]]                         # [B]
        p_len = self.prompt_len.numpy()[prompts]                               # [B]
        r_len = np.where(keep, self.response_len.numpy()[idx], 0)              # [B, K]
        P_b, R_b = int(p_len.max()), max(int(r_len.max()), 1)

        def gather(field, empty):                                              # [B, K]
            return torch.from_numpy(np.where(keep, field.numpy()[idx], empty))
        response_ids = self.response_ids.numpy()[idx, :R_b].astype(np.int64)   # [B, K, R']
        response_ids[~keep] = self.pad_id      # in place: no second [B, K, R'] array
        return GroupBatch(
            prompt_ids=torch.from_numpy(self.prompt_ids.numpy()[prompts, -P_b:].astype(np.int64)),
            prompt_mask=torch.from_numpy(np.arange(P_b) >= P_b - p_len[:, None]).long(),  # [B, P']
            response_ids=torch.from_numpy(response_ids),
            response_len=torch.from_numpy(r_len),
            reward=gather(self.reward, 0.0),
            ref_logp=gather(self.ref_logp, 0.0),
            behaviour_logp=gather(self.behaviour_logp, 0.0),
            version=gather(self.version, REFERENCE),
            search_temperature=gather(self.search_temperature, math.nan),
            from_reference=torch.from_numpy(keep & (self.version.numpy()[idx] == REFERENCE)),
            keep=torch.from_numpy(keep),
            prompt_index=torch.from_numpy(prompts),
            order=gather(self.order, -1),
            draws=gather(self.draws, 0),
            recent_count=recent_count)

    # --- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict:
        with self._lock:
            state = {name: getattr(self, name).clone() for name in self.FIELDS}
            state["n_added"] = int(self.n_added[0])
        return state

    def load_state_dict(self, state: dict, max_version: int) -> None:
        """Restore a `state_dict` of versions up to `max_version` (the checkpoint's step)."""
        saved_state.check(self, state, versions=(REFERENCE, max_version))
        n_added = state["n_added"]
        with self._lock:
            for name in self.FIELDS:
                getattr(self, name).copy_(state[name])
            self.n_added[0] = n_added
