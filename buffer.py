"""Replay buffer of completions, shared between processes; groups are formed when drawn.

As in TBA's reference code and GFlowNet red-teaming: keep what the search found, completion by
completion, and train on it again and again.
- `add` stores each completion of a searched group in a slot of its own (`_store_one`), beside
  the other completions of the same prompt: an exact duplicate is stored once (`dedup`), a
  near-duplicate (embeddings with cosine >= `merge_cosine`) only if it is better.
- When the buffer, or the prompt's share of it (`per_prompt`), is full, a completion is evicted
  (`_victim`): the oldest (``evict="oldest"``) or the lowest reward (``"lowest"``, GFlowNet
  style: the best attacks stay however old they are).
- `sample` forms each trained group at draw time (`_draw_group`): it picks a prompt, then up to K
  of its completions: with probability m among the newest weights' (recency), otherwise by reward
  (a softmax at `priority_temp`) or uniformly (the picks: draws.py). A group may mix weight versions and temperatures:
  each completion carries its own behaviour log-prob and version.

Searchers run in processes started with the ``spawn`` method; the trainer runs in the main
process. Every field is a fixed-size tensor moved to shared memory (``share_memory_()``), so
``Process(args=(buffer,))`` sends only handles to the same storage; one lock guards every
field, so a reader never sees a half-written completion and two writers never claim one slot.

Layout (C = capacity in completions, N = prompts of the dataset, P = max_prompt_len,
R = max_response_len, D = embedding_dim): a prompt table [N, P] indexed by the prompt's index,
LEFT padded; completion slots [C, R], RIGHT padded. Masks come from stored lengths, never from
``token == pad_id`` (pad and EOS may be the same id). Token ids are int32, returned as int64.
A slot is empty when its prompt index is -1. A completion the frozen reference sampled has
version `REFERENCE` (-1): it is of no policy version, so it is never "recent", never stale, and
counts in no staleness.
"""
import math
from dataclasses import dataclass, fields
from typing import Optional

import numpy as np
import torch
import torch.multiprocessing as mp

import checkpoint
from draws import Pool, draw_without_replacement, groups_in

REFERENCE = -1      # the version of a completion sampled by the frozen reference model


@dataclass
class GroupBatch:
    """B groups of up to K completions, widths trimmed to the longest prompt / response.
    A group drawn with fewer than K completions is padded: `keep` is False there."""
    prompt_ids: torch.Tensor    # [B, P'] int64, left padded
    prompt_mask: torch.Tensor   # [B, P'] int64, 1 on prompt tokens
    response_ids: torch.Tensor  # [B, K, R'] int64, right padded
    response_len: torch.Tensor  # [B, K] int64, response tokens incl. the EOS that ended it
    reward: torch.Tensor        # [B, K] float32
    ref_logp: torch.Tensor      # [B, K] float32, sum of reference log-probs over the response
    version: torch.Tensor       # [B, K] int64, weight version that sampled it (REFERENCE: -1)
    prompt_index: torch.Tensor  # [B] int64, index of the prompt in the dataset
    behaviour_logp: Optional[torch.Tensor] = None  # [B, K] float32, log μ(y|x) summed over the
                                # response, under the weights that sampled it (NaN: not recorded)
    search_temperature: Optional[torch.Tensor] = None  # [B, K] float32, temperature it was sampled at
    from_reference: Optional[torch.Tensor] = None  # [B, K] bool, sampled by the reference model
    keep: Optional[torch.Tensor] = None  # [B, K] bool, False: no completion there (None: all real)
    embedding: Optional[torch.Tensor] = None  # [B, K, D] fresh from a search: the task's embeddings
    order: Optional[torch.Tensor] = None  # [B, K] int64, insertion order (global counter)
    draws: Optional[torch.Tensor] = None  # [B, K] int64, times drawn, this one included
    recent_count: int = 0       # how many of the B groups were drawn from the newest-version pool
    info: object = None         # fresh from a search (never in the buffer): the task's `score` info

    def to(self, device) -> "GroupBatch":
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return GroupBatch(**{name: v.to(device) if isinstance(v, torch.Tensor) else v
                             for name, v in values.items()})

    def kept(self) -> torch.Tensor:
        """[B, K] bool: the completions that are really there, to train on and count."""
        return torch.ones_like(self.reward, dtype=torch.bool) if self.keep is None else self.keep

    @staticmethod
    def cat(batches, pad_id: int) -> "GroupBatch":
        """The groups of several batches as one, on the first one's device: prompts left padded
        and responses right padded to the widest. Fields only a fresh search has (embedding,
        info) are dropped; a fresh group counts as drawn once, from no slot (order -1)."""
        device = batches[0].reward.device
        P = max(b.prompt_ids.shape[1] for b in batches)
        R = max(b.response_ids.shape[2] for b in batches)

        def joined(field, width=None, pad=0, left=False, missing=None):   # [B, ...] of them all
            parts = []
            for b in batches:
                t = getattr(b, field)
                t = (missing(b) if t is None else t).to(device)
                if width is not None:
                    gap = width - t.shape[-1]
                    t = torch.nn.functional.pad(t, (gap, 0) if left else (0, gap), value=pad)
                parts.append(t)
            return torch.cat(parts)

        def nan(b):
            return torch.full_like(b.reward, math.nan)
        return GroupBatch(
            prompt_ids=joined("prompt_ids", P, pad_id, left=True),              # [B, P']
            prompt_mask=joined("prompt_mask", P, 0, left=True),                 # [B, P']
            response_ids=joined("response_ids", R, pad_id),                     # [B, K, R']
            response_len=joined("response_len"), reward=joined("reward"),       # [B, K] each
            ref_logp=joined("ref_logp"), version=joined("version"),
            prompt_index=joined("prompt_index"),                                # [B]
            behaviour_logp=joined("behaviour_logp", missing=nan),
            search_temperature=joined("search_temperature", missing=nan),
            from_reference=joined("from_reference", missing=lambda b: b.version == REFERENCE),
            keep=joined("keep", missing=GroupBatch.kept),
            order=joined("order", missing=lambda b: torch.full_like(b.version, -1)),
            draws=joined("draws", missing=lambda b: torch.ones_like(b.version)),
            recent_count=sum(b.recent_count for b in batches))


def shared_bytes(capacity, max_prompt_len, max_response_len, n_prompts, embedding_dim=0):
    """Shared memory a ReplayBuffer of this shape takes, to check /dev/shm before making one:
    the prompt table (int32 tokens, a length) and per completion its tokens (int32), reward,
    reference and behaviour log-probs, temperature and embedding (float32), and five int64
    numbers (length, version, prompt index, order, draws)."""
    P, R, D = max_prompt_len, max_response_len, embedding_dim
    return n_prompts * (4 * P + 8) + capacity * (4 * R + 4 * (4 + D) + 5 * 8) + 8


class ReplayBuffer:
    _FIELDS = ("prompt_ids", "prompt_len", "response_ids", "response_len", "reward", "ref_logp",
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
        if evict not in ("oldest", "lowest"):
            raise ValueError(f"evict must be 'oldest' or 'lowest', got {evict!r}")
        if per_prompt < 0 or 0 < per_prompt < 2:
            raise ValueError(f"per_prompt must be 0 (no bound) or >= 2, got {per_prompt}")
        if merge_cosine and (not 0 < merge_cosine <= 1 or D < 1):
            raise ValueError(f"merge_cosine must be in (0, 1] with embedding_dim >= 1, got "
                             f"{merge_cosine} and {D}")
        self.capacity, self.group_size, self.n_prompts = C, K, N
        self.max_prompt_len, self.max_response_len, self.pad_id = P, R, pad_id
        self.per_prompt, self.evict = per_prompt or C, evict
        self.dedup, self.merge_cosine = dedup, merge_cosine
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
        for name in self._FIELDS + ("n_added",):
            getattr(self, name).share_memory_()
        # A spawn-context lock pickles into processes started with the spawn method.
        self._lock = mp.get_context("spawn").Lock()

    def __len__(self) -> int:
        """Completions stored."""
        with self._lock:
            return int((self.prompt_index >= 0).sum())

    # Selection runs in NumPy, on views of the shared tensors (`.numpy()` shares their memory):
    # on 50,000 completions its masks and searches cost a seventh of torch's per call. The
    # weights and random picks of a draw are in draws.py.

    def _available(self, min_version, max_reuse):
        """[C] bool (NumPy): the completions that may be drawn: stored, fresh enough (a
        reference sample is never stale), not used up."""
        index, version = self.prompt_index.numpy(), self.version.numpy()
        available = (index >= 0) & ((version >= min_version) | (version == REFERENCE))   # [C]
        if max_reuse:
            available &= self.draws.numpy() < max_reuse
        return available

    def _counts(self, mask):
        """[N] (NumPy) how many of the completions in `mask` [C] each prompt has."""
        return np.bincount(self.prompt_index.numpy()[mask], minlength=self.n_prompts)

    def count(self, min_version: int = -1, max_reuse: int = 0) -> int:
        """Number of groups that ``sample`` can draw at least, with the same bounds."""
        with self._lock:
            return groups_in(self._counts(self._available(min_version, max_reuse)),
                             self.group_size)

    # --- store ---------------------------------------------------------------------------------

    def add(self, prompt_ids, response_ids, response_len, reward, ref_logp, behaviour_logp,
            version, prompt_index: int, search_temperature=math.nan, embedding=None) -> int:
        """Store a searched group's completions. ``prompt_ids``: 1-D, UNPADDED ([p], p <= P);
        ``response_ids``: [k, r], r <= R, right padded; ``response_len``, ``reward``,
        ``ref_logp``, ``behaviour_logp``: [k]; ``version``, ``search_temperature``: one
        number or [k] (version REFERENCE: sampled by the reference); ``embedding``: [k, D],
        needed with merging. Tokens past each response's length are stored as pad_id.
        -> how many completions were stored (dedup, merging and eviction may leave some out)"""
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
        if prompt.dim() != 1 or not 1 <= prompt.numel() <= P:
            raise ValueError(f"prompt_ids must be 1-D unpadded with length in [1, "
                             f"max_prompt_len={P}], got shape {tuple(prompt.shape)}")
        if k < 1 or resp.shape[1] > R:
            raise ValueError(f"response_ids must be [k, r] with k >= 1 and r <= "
                             f"max_response_len={R}, got shape {tuple(resp.shape)}")
        for name, t in (("response_len", lens), *per_completion.items()):
            if t.shape != (k,):
                raise ValueError(f"{name} must have shape [{k}], got {tuple(t.shape)}")
        if lens.min() < 1 or lens.max() > resp.shape[1]:
            raise ValueError(f"response_len must lie in [1, {resp.shape[1]}], got {lens.tolist()}")
        if not 0 <= prompt_index < self.n_prompts:
            raise ValueError(f"prompt_index must be in [0, n_prompts={self.n_prompts}), got "
                             f"{prompt_index}")
        if self.merge_cosine and embedding is None:
            raise ValueError("this buffer merges near-duplicates: add needs the embeddings")
        # Build the padded rows outside the lock; only the copy into shared memory is locked.
        p_row = torch.full((P,), self.pad_id, dtype=torch.int32)              # [P]
        p_row[P - prompt.numel():] = prompt
        r_rows = torch.full((k, R), self.pad_id, dtype=torch.int32)           # [k, R]
        r_rows[:, :resp.shape[1]] = resp
        r_rows[torch.arange(R) >= lens[:, None]] = self.pad_id
        if self.merge_cosine:
            embedding = torch.nn.functional.normalize(torch.as_tensor(embedding).float(), dim=-1)
        stored = 0
        with self._lock:
            self.prompt_ids[prompt_index], self.prompt_len[prompt_index] = p_row, prompt.numel()
            for i in per_completion["reward"].argsort(descending=True, stable=True).tolist():
                completion = {name: t[i] for name, t in per_completion.items()}   # best first:
                stored += self._store_one(prompt_index, r_rows[i], lens[i], completion,  # it stays
                                          None if embedding is None else embedding[i])
        return stored

    def _store_one(self, prompt_index, tokens, length, completion, embedding) -> bool:
        """Store one completion (under the lock). -> whether it was stored

        dedup: an exact copy of a stored completion of the prompt replaces it in place (the
        newest copy is kept, with its own version and log μ). merge_cosine: if stored
        completions of the prompt are near it, the best of them is kept if it is at least as
        good, and counts as found again (its age is renewed, so "oldest" eviction cannot take
        what keeps being rediscovered); else they all make way for it."""
        mine = torch.from_numpy(np.flatnonzero(self.prompt_index.numpy() == prompt_index))  # [m]
        slot = None
        if self.dedup:
            same = mine[(self.response_len[mine] == length)
                        & (self.response_ids[mine] == tokens).all(1)]          # [0 or 1]
            slot = int(same[0]) if len(same) else None
        if slot is None and self.merge_cosine:
            is_near = self.embedding[mine] @ embedding >= self.merge_cosine    # [m]
            near = mine[is_near]
            if len(near):
                best = int(near[self.reward[near].argmax()])
                if self.reward[best] >= completion["reward"]:
                    self.order[best] = self._next_order()
                    return False
                self.prompt_index[near] = -1                                   # made way
                mine = mine[~is_near]
        if slot is None:
            slot = self._victim(mine, completion["reward"])
            if slot is None:
                return False
        self.response_ids[slot], self.response_len[slot] = tokens, length
        for name, value in completion.items():
            getattr(self, name)[slot] = value
        if self.merge_cosine:
            self.embedding[slot] = embedding
        self.prompt_index[slot], self.order[slot] = prompt_index, self._next_order()
        self.draws[slot] = 0
        return True

    def _next_order(self) -> int:
        n = int(self.n_added[0])
        self.n_added[0] = n + 1
        return n

    def _victim(self, mine, reward) -> Optional[int]:
        """The slot a new completion of reward `reward` goes to (under the lock): a free one,
        or one whose completion is evicted. `mine` [m]: the slots of its prompt. A prompt at
        `per_prompt` evicts one of its own; a full buffer evicts the oldest of all ("oldest"),
        or ("lowest") the lowest reward of the prompt holding the most. Among equal rewards the
        oldest goes. -> None when "lowest" finds the new one worse than all its prompt holds."""
        index = self.prompt_index.numpy()                                      # [C]
        own = len(mine) >= self.per_prompt
        if not own and (index < 0).any():
            return int((index < 0).argmax())                                   # the first free
        if own:
            candidates = mine
        elif self.evict == "oldest":                                           # of all stored
            return int(np.where(index >= 0, self.order.numpy(), np.iinfo(np.int64).max).argmin())
        else:
            largest = self._counts(index >= 0).argmax()
            own = largest == self.prompt_index[mine[0]] if len(mine) else False
            candidates = torch.from_numpy(np.flatnonzero(index == largest))
        if self.evict == "lowest":
            lowest = self.reward[candidates].min()
            if own and reward < lowest:
                return None
            candidates = candidates[self.reward[candidates] == lowest]
        return int(candidates[self.order[candidates].argmin()])

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
            policy = (index >= 0) & (version != REFERENCE)                     # [C]
            newest = version[policy].max() if policy.any() else REFERENCE - 1
            recent_mask = available & (version == newest)                      # [C]
            prompt_reward, log_weight = None, np.zeros(len(drawable))          # [A] uniform
            if priority_temp is not None:
                drawable_reward = reward[drawable].astype(np.float64)          # [A]
                prompt_reward = np.bincount(drawable_prompt, weights=drawable_reward,
                                            minlength=self.n_prompts) / np.maximum(left, 1)
                log_weight = drawable_reward / priority_temp                   # [A]
            everything = Pool(available, left, prompt_reward, priority_temp)
            recent = Pool(recent_mask, self._counts(recent_mask))
            # One draw from the caller's torch generator seeds this sample's NumPy generator:
            # the draws are as reproducible (and resumable) as the torch generator's state, at
            # a microsecond each instead of torch's tens.
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
        response_ids[~keep] = self.pad_id      # (faster than a masked copy with np.where)
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
            state = {name: getattr(self, name).clone() for name in self._FIELDS}
            state["n_added"] = int(self.n_added[0])
        return state

    def load_state_dict(self, state: dict, max_version: int) -> None:
        """Restore a `state_dict` of weights up to `max_version` (the checkpoint's step), once
        `checkpoint.check_buffer_state` has found it possible."""
        checkpoint.check_buffer_state(self, state, versions=(REFERENCE, max_version))
        n_added = state["n_added"]
        with self._lock:
            for name in self._FIELDS:
                getattr(self, name).copy_(state[name])
            self.n_added[0] = n_added
