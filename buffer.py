"""Replay buffer of groups (one prompt, K completions) shared between processes.

Searchers run in processes started with the ``spawn`` method; the trainer runs in the main
process. Every field lives in a fixed-size torch tensor moved to shared memory
(``share_memory_()``), so passing the buffer to ``Process(args=(buffer,))`` sends only handles
to the same storage: a group is written once, in place, and never pickled per step.
One lock guards every field and the write counter, so a reader copying a batch out never sees
a half-written ("torn") group, and two writers never claim the same slot.

Layout (C = capacity, K = group_size, P = max_prompt_len, R = max_response_len):
prompts are LEFT padded (the tokens end at column P), responses RIGHT padded, and masks are
derived from stored lengths, never from ``token == pad_id`` (pad and EOS may be the same id).
Token ids are stored as int32 to halve the memory and returned as int64.

The ring is filled from slot 0 and slot ``n_added % C`` is overwritten next, so the valid slots
are always ``0 .. len(buffer) - 1`` and the oldest group is evicted first.

What was found is kept once, on request: with ``dedup`` a completion of a prompt is stored
once, its newest copy (an older copy in the buffer is left out, so what the searchers keep
finding stays in fresh groups instead of ageing out of the ring), and with ``merge_cosine``
c > 0 completions of a prompt whose embeddings have cosine >= c are near-duplicates of which
only the higher reward is kept. A completion left out stays in its group's row with ``keep``
False and counts nowhere (loss, metrics, priority); a group with fewer than 2 kept completions
teaches trajectory balance nothing (log Ẑ is fitted to the group) and is not drawn.
"""
import math
from dataclasses import dataclass, fields
from typing import Optional

import torch
import torch.multiprocessing as mp


@dataclass
class GroupBatch:
    """B groups copied out of the buffer; widths trimmed to the longest prompt / response."""
    prompt_ids: torch.Tensor    # [B, P'] int64, left padded
    prompt_mask: torch.Tensor   # [B, P'] int64, 1 on prompt tokens
    response_ids: torch.Tensor  # [B, K, R'] int64, right padded
    response_len: torch.Tensor  # [B, K] int64, response tokens incl. the EOS that ended it
    reward: torch.Tensor        # [B, K] float32
    ref_logp: torch.Tensor      # [B, K] float32, sum of reference log-probs over the response
    version: torch.Tensor       # [B] int64, weight version that generated the group
    prompt_index: torch.Tensor  # [B] int64, index of the prompt in the dataset
    behaviour_logp: Optional[torch.Tensor] = None  # [B, K] float32, log μ(y|x) summed over the
                                # response, under the weights that sampled it (NaN: not recorded)
    search_temperature: Optional[torch.Tensor] = None  # [B] float32, temperature it was sampled at
    from_reference: Optional[torch.Tensor] = None  # [B] bool, sampled by the reference model
    keep: Optional[torch.Tensor] = None  # [B, K] bool, False: a duplicate left out (None: all kept)
    embedding: Optional[torch.Tensor] = None  # [B, K, D] fresh from a search: the task's embeddings
    order: Optional[torch.Tensor] = None  # [B] int64, insertion order (global counter)
    draws: Optional[torch.Tensor] = None  # [B] int64, times each group has been drawn, this one included
    recent_count: int = 0       # how many of the B slots were drawn from the newest-version pool
    info: object = None         # fresh from a search (never in the buffer): the task's `score` info

    def to(self, device) -> "GroupBatch":
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return GroupBatch(**{name: v.to(device) if isinstance(v, torch.Tensor) else v
                             for name, v in values.items()})


def pick(weights, generator=None) -> int:
    """One index drawn with probability ∝ weights (float64, >= 0), by inverting the CDF:
    a tenth of the cost of torch.multinomial on a 10,000-group buffer."""
    cdf = weights.cumsum(0)                                                    # [n]
    u = torch.rand((), generator=generator, dtype=torch.float64) * cdf[-1]
    return int(torch.searchsorted(cdf, u, right=True).clamp(max=len(cdf) - 1))


def priority_weights(group_reward, available, priority_temp) -> torch.Tensor:
    """Softmax numerators exp(reward / priority_temp) of the available groups, 0 for the others.
    Shifted so that the best available group weighs exactly 1: nothing overflows, and however
    small priority_temp is, the weights of what is left never all underflow to 0.
    group_reward: [n] float64 mean reward of each group; available: [n] bool.      -> [n]"""
    logits = group_reward / priority_temp                                      # [n]
    return torch.where(available, (logits - logits[available].max()).exp(), 0.0)


def shared_bytes(capacity, group_size, max_prompt_len, max_response_len, embedding_dim=0):
    """Shared memory a ReplayBuffer of this shape takes, to check /dev/shm before making one:
    per group the prompt and K responses (int32), K lengths, rewards, reference and behaviour
    log-probs, keep flags and embeddings, five int64 counters (prompt length, version, prompt
    index, order, draws), its temperature and whether the reference sampled it."""
    K, P, R, D = group_size, max_prompt_len, max_response_len, embedding_dim
    return capacity * (4 * P + 4 * K * R + (8 + 4 + 4 + 4 + 1 + 4 * D) * K + 5 * 8 + 4 + 1) + 8


class ReplayBuffer:
    _FIELDS = ("prompt_ids", "prompt_len", "response_ids", "response_len", "reward",
               "ref_logp", "behaviour_logp", "keep", "embedding", "version", "prompt_index",
               "order", "draws", "search_temperature", "from_reference")
    # What a state written before a field existed gets: (value, what it means).
    _ADDED = {"behaviour_logp": math.nan,        # not recorded
              "keep": True,                      # nothing was left out
              "embedding": 0.0,                  # none (a buffer without merging)
              "search_temperature": math.nan,    # not recorded
              "from_reference": False}

    def __init__(self, capacity: int, group_size: int, max_prompt_len: int,
                 max_response_len: int, pad_id: int = 0, dedup: bool = False,
                 merge_cosine: float = 0.0, embedding_dim: int = 0):
        C, K, P, R, D = capacity, group_size, max_prompt_len, max_response_len, embedding_dim
        if min(C, K, P, R) < 1:
            raise ValueError("capacity, group_size, max_prompt_len, max_response_len must be >= 1")
        if merge_cosine and (not 0 < merge_cosine <= 1 or D < 1):
            raise ValueError(f"merge_cosine must be in (0, 1] with embedding_dim >= 1, got "
                             f"{merge_cosine} and {D}")
        self.capacity, self.group_size = C, K
        self.max_prompt_len, self.max_response_len, self.pad_id = P, R, pad_id
        self.dedup, self.merge_cosine = dedup, merge_cosine
        self.prompt_ids = torch.full((C, P), pad_id, dtype=torch.int32)       # [C, P]
        self.prompt_len = torch.zeros(C, dtype=torch.int64)                   # [C]
        self.response_ids = torch.full((C, K, R), pad_id, dtype=torch.int32)  # [C, K, R]
        self.response_len = torch.zeros(C, K, dtype=torch.int64)              # [C, K]
        self.reward = torch.zeros(C, K, dtype=torch.float32)                  # [C, K]
        self.ref_logp = torch.zeros(C, K, dtype=torch.float32)                # [C, K]
        self.behaviour_logp = torch.zeros(C, K, dtype=torch.float32)          # [C, K] log μ
        self.keep = torch.ones(C, K, dtype=torch.bool)                        # [C, K]
        self.embedding = torch.zeros(C, K, D, dtype=torch.float32)            # [C, K, D], unit
        self.version = torch.full((C,), -1, dtype=torch.int64)                # [C]
        self.prompt_index = torch.full((C,), -1, dtype=torch.int64)           # [C]
        self.order = torch.full((C,), -1, dtype=torch.int64)                  # [C]
        self.draws = torch.zeros(C, dtype=torch.int64)                        # [C] times sampled
        self.search_temperature = torch.zeros(C, dtype=torch.float32)         # [C]
        self.from_reference = torch.zeros(C, dtype=torch.bool)                # [C]
        self.n_added = torch.zeros(1, dtype=torch.int64)                      # [1] groups ever added
        for name in self._FIELDS + ("n_added",):
            getattr(self, name).share_memory_()
        # A spawn-context lock pickles into processes started with the spawn method.
        self._lock = mp.get_context("spawn").Lock()

    def __len__(self) -> int:
        with self._lock:
            return min(int(self.n_added[0]), self.capacity)

    def _available(self, n, min_version, max_reuse):
        """[n] bool: the groups that may still be drawn (fresh enough, not used up)."""
        available = (self.version[:n] >= min_version) & (self.keep[:n].sum(1) >= 2)   # [n]
        if max_reuse:
            available &= self.draws[:n] < max_reuse
        return available

    def count(self, min_version: int = -1, max_reuse: int = 0) -> int:
        """Number of groups that ``sample`` could draw with the same bounds."""
        with self._lock:
            n = min(int(self.n_added[0]), self.capacity)
            return int(self._available(n, min_version, max_reuse).sum())

    def newest_version(self) -> Optional[int]:
        """Highest weight version present in the buffer (None when empty)."""
        with self._lock:
            n = min(int(self.n_added[0]), self.capacity)
            return int(self.version[:n].max()) if n else None

    def add(self, prompt_ids, response_ids, response_len, reward, ref_logp, behaviour_logp,
            version: int, prompt_index: int, search_temperature: float = math.nan,
            from_reference: bool = False, embedding=None) -> int:
        """Add one group. ``prompt_ids``: 1-D, UNPADDED ([p], p <= P; left-padded here).
        ``response_ids``: [K, r], r <= R, right padded; ``response_len``, ``reward``,
        ``ref_logp``, ``behaviour_logp``: [K]; ``embedding``: [K, D], needed with merging.
        Tokens past each response's length are overwritten with pad_id.
        -> how many of its completions were kept (`_new_completions`); below 2 the group is
        not stored."""
        K, P, R = self.group_size, self.max_prompt_len, self.max_response_len
        prompt = torch.as_tensor(prompt_ids)
        resp = torch.as_tensor(response_ids)
        lens = torch.as_tensor(response_len, dtype=torch.int64)
        reward = torch.as_tensor(reward, dtype=torch.float32)
        ref_logp = torch.as_tensor(ref_logp, dtype=torch.float32)
        behaviour_logp = torch.as_tensor(behaviour_logp, dtype=torch.float32)
        if prompt.dim() != 1 or prompt.numel() > P:
            raise ValueError(f"prompt_ids must be 1-D unpadded with length <= max_prompt_len={P}, "
                             f"got shape {tuple(prompt.shape)}")
        if resp.dim() != 2 or resp.shape[0] != K or resp.shape[1] > R:
            raise ValueError(f"response_ids must be [group_size={K}, r] with r <= "
                             f"max_response_len={R}, got shape {tuple(resp.shape)}")
        for name, t in (("response_len", lens), ("reward", reward), ("ref_logp", ref_logp),
                        ("behaviour_logp", behaviour_logp)):
            if t.shape != (K,):
                raise ValueError(f"{name} must have shape [{K}], got {tuple(t.shape)}")
        if lens.min() < 0 or lens.max() > resp.shape[1]:
            raise ValueError(f"response_len must lie in [0, {resp.shape[1]}], got {lens.tolist()}")
        # Build the padded rows outside the lock; only the copy into shared memory is locked.
        p_row = torch.full((P,), self.pad_id, dtype=torch.int32)              # [P]
        p_row[P - prompt.numel():] = prompt
        r_rows = torch.full((K, R), self.pad_id, dtype=torch.int32)           # [K, R]
        r_rows[:, :resp.shape[1]] = resp
        r_rows[torch.arange(R) >= lens[:, None]] = self.pad_id
        if self.merge_cosine:
            if embedding is None:
                raise ValueError("this buffer merges near-duplicates: add needs the embeddings")
            embedding = torch.nn.functional.normalize(torch.as_tensor(embedding).float(), dim=-1)
        with self._lock:
            keep, slots, stored_keep = self._new_completions(r_rows, lens, reward, embedding,
                                                             prompt_index)
            if keep.sum() < 2:
                return int(keep.sum())
            self.keep[slots] = stored_keep
            n = int(self.n_added[0])
            s = n % self.capacity  # the oldest slot once the ring is full
            self.prompt_ids[s] = p_row
            self.prompt_len[s] = prompt.numel()
            self.response_ids[s] = r_rows
            self.response_len[s] = lens
            self.reward[s] = reward
            self.ref_logp[s] = ref_logp
            self.behaviour_logp[s] = behaviour_logp
            self.keep[s] = keep
            if self.merge_cosine:
                self.embedding[s] = embedding
            self.version[s] = int(version)
            self.prompt_index[s] = int(prompt_index)
            self.order[s] = n
            self.draws[s] = 0
            self.search_temperature[s] = search_temperature
            self.from_reference[s] = from_reference
            self.n_added[0] = n + 1
        return int(keep.sum())

    def _new_completions(self, r_rows, lens, reward, embedding, prompt_index):
        """Which of a new group's K completions to keep, and of the stored ones of its prompt
        (called under the lock). -> keep [K] bool, slots [m] of the prompt's stored groups,
        their keep flags [m, K] once this group is stored

        dedup: a completion equal (same tokens, same length) to an earlier one of its group is
        left out, and so are the stored copies of the completions it keeps: each is stored
        once, in its newest group. merge_cosine c: a completion whose embedding has cosine >= c
        with kept ones of the same prompt (in its group or stored) is merged with them: the
        highest reward stays, stored ones included. The group in the slot about to be
        overwritten counts as stored: harmless."""
        K = self.group_size
        keep = torch.ones(K, dtype=torch.bool)                                 # [K]
        n = min(int(self.n_added[0]), self.capacity)
        slots = (self.prompt_index[:n] == prompt_index).nonzero().flatten()    # [m]
        stored_keep = self.keep[slots].clone()                                 # [m, K]
        if self.dedup:
            key = torch.cat([lens[:, None].int(), r_rows], 1)                  # [K, R+1]
            equal = (key[:, None] == key[None]).all(-1)                        # [K, K]
            keep &= ~equal.tril(-1).any(1)                                     # first copy only
            stored = torch.cat([self.response_len[slots, :, None].int(),
                                self.response_ids[slots]], 2)                  # [m, K, R+1]
            stored_keep &= ~(stored[None] == key[keep, None, None]).all(-1).any(0)
        if self.merge_cosine:
            flat_keep = stored_keep.view(-1)                                   # [m·K], a view
            stored_emb = self.embedding[slots].flatten(0, 1)                   # [m·K, D]
            stored_reward = self.reward[slots].flatten()                       # [m·K]
            for i in reward.argsort(descending=True).tolist():    # best first, so it stays
                if not keep[i]:
                    continue
                near_new = (embedding @ embedding[i] >= self.merge_cosine) & keep    # [K]
                near_new[i] = False
                keep &= ~near_new                                 # worse ones of its group
                near = (stored_emb @ embedding[i] >= self.merge_cosine) & flat_keep   # [m·K]
                if near.any() and stored_reward[near].max() >= reward[i]:
                    keep[i] = False                               # a stored one is as good
                else:                                             # it replaces them, if any
                    flat_keep &= ~near
        return keep, slots, stored_keep

    def sample(self, n_groups: int, recent_frac: float, priority_temp: Optional[float] = None,
               generator: Optional[torch.Generator] = None, min_version: int = -1,
               max_reuse: int = 0) -> GroupBatch:
        """Draw ``n_groups`` distinct groups. Slot by slot: with probability ``recent_frac`` a
        uniform pick among not-yet-chosen groups of the newest version; otherwise (or when that
        pool is used up) a pick among all not-yet-chosen groups, uniform or, with
        ``priority_temp``, with probability ∝ exp(mean group reward / priority_temp).
        Groups older than ``min_version`` are never drawn (a bound on staleness), nor, when
        ``max_reuse`` > 0, groups already drawn that many times (a bound on replay)."""
        if not 0.0 <= recent_frac <= 1.0:
            raise ValueError(f"recent_frac must be in [0, 1], got {recent_frac}")
        if priority_temp is not None and priority_temp <= 0:
            raise ValueError(f"priority_temp must be > 0, got {priority_temp}")
        with self._lock:  # held for selection and copy: the chosen groups cannot change meanwhile
            n = min(int(self.n_added[0]), self.capacity)
            available = self._available(n, min_version, max_reuse)            # [n]
            if not 1 <= n_groups <= int(available.sum()):
                raise ValueError(f"cannot sample {n_groups} distinct groups from a buffer "
                                 f"holding {int(available.sum())} of version >= {min_version}"
                                 + (f" drawn fewer than {max_reuse} times" if max_reuse else ""))
            is_recent = self.version[:n] == self.version[:n].max()             # [n]
            if priority_temp is not None:
                kept = self.keep[:n].double()                                  # [n, K]
                group_reward = ((self.reward[:n].double() * kept).sum(1)
                                / kept.sum(1).clamp(min=1))                    # [n]
                priority = priority_weights(group_reward, available, priority_temp)  # [n]
            chosen, recent_count = [], 0
            for _ in range(n_groups):
                pool = available & is_recent
                if torch.rand((), generator=generator) < recent_frac and pool.any():
                    weights, recent_count = pool.double(), recent_count + 1
                elif priority_temp is None:
                    weights = available.double()
                else:  # taking groups out only renormalises the rest (Plackett-Luce)...
                    if priority.sum() == 0:  # ...unless all that is left underflowed: re-shift
                        priority = priority_weights(group_reward, available, priority_temp)
                    weights = priority
                i = pick(weights, generator)
                available[i] = False
                if priority_temp is not None:
                    priority[i] = 0.0                                          # drawn: out
                chosen.append(i)
            idx = torch.tensor(chosen)                                         # [B]
            self.draws[idx] += 1
            p_len, r_len = self.prompt_len[idx], self.response_len[idx]        # [B], [B, K]
            P_b, R_b = max(int(p_len.max()), 1), max(int(r_len.max()), 1)
            batch = GroupBatch(
                prompt_ids=self.prompt_ids[idx, self.max_prompt_len - P_b:].long(),  # [B, P']
                prompt_mask=(torch.arange(P_b) >= P_b - p_len[:, None]).long(),     # [B, P']
                response_ids=self.response_ids[idx, :, :R_b].long(),                # [B, K, R']
                response_len=r_len,
                reward=self.reward[idx],
                ref_logp=self.ref_logp[idx],
                behaviour_logp=self.behaviour_logp[idx],
                search_temperature=self.search_temperature[idx],
                from_reference=self.from_reference[idx],
                keep=self.keep[idx],
                version=self.version[idx],
                prompt_index=self.prompt_index[idx],
                order=self.order[idx],
                draws=self.draws[idx],
                recent_count=recent_count)
        return batch

    def state_dict(self) -> dict:
        with self._lock:
            state = {name: getattr(self, name).clone() for name in self._FIELDS}
            state["n_added"] = int(self.n_added[0])
        return state

    def load_state_dict(self, state: dict, max_version: int) -> None:
        """Restore a `state_dict`, after checking that it could have come from this buffer with
        weights up to `max_version` (the checkpoint's step): a file with the right shapes but
        impossible values would otherwise be trained on, or crash a searcher much later.
        A state written before a field existed gets its `_ADDED` value (NaN: not known)."""
        state = {**state, **{name: torch.full_like(getattr(self, name), value)
                             for name, value in self._ADDED.items() if name not in state}}
        for name in self._FIELDS:
            if name not in state:
                raise ValueError(f"buffer state_dict is missing '{name}'")
            want, got = getattr(self, name), state[name]
            if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
                raise ValueError(
                    f"buffer state_dict '{name}' is {_describe(got)} but this buffer expects "
                    f"{_describe(want)} (capacity={self.capacity}, group_size={self.group_size}, "
                    f"max_prompt_len={self.max_prompt_len}, "
                    f"max_response_len={self.max_response_len})")
        n_added = state.get("n_added")
        if not isinstance(n_added, int) or n_added < 0:
            raise ValueError(f"buffer state_dict 'n_added' must be a count >= 0, got {n_added!r}")
        n = min(n_added, self.capacity)
        filled = {name: state[name][:n] for name in self._FIELDS}
        rules = [  # (what is wrong, the offending values) for the n filled slots
            (f"versions outside [0, {max_version}]",
             filled["version"][(filled["version"] < 0) | (filled["version"] > max_version)]),
            (f"prompt lengths outside [1, {self.max_prompt_len}]",
             filled["prompt_len"][(filled["prompt_len"] < 1)
                                  | (filled["prompt_len"] > self.max_prompt_len)]),
            (f"response lengths outside [1, {self.max_response_len}]",
             filled["response_len"][(filled["response_len"] < 1)
                                    | (filled["response_len"] > self.max_response_len)]),
            ("non-finite rewards", filled["reward"][~filled["reward"].isfinite()]),
            ("non-finite reference log-probs", filled["ref_logp"][~filled["ref_logp"].isfinite()]),
            ("infinite behaviour log-probs", filled["behaviour_logp"][
                filled["behaviour_logp"].isinf()]),
            ("negative prompt indices", filled["prompt_index"][filled["prompt_index"] < 0]),
            ("negative draw counts", filled["draws"][filled["draws"] < 0]),
        ]
        if not torch.equal(filled["order"].sort().values, torch.arange(n_added - n, n_added)):
            rules.append((f"insertion orders that are not {n_added - n}..{n_added - 1}",
                          filled["order"]))
        for problem, values in rules:
            if values.numel():
                raise ValueError(f"buffer state_dict holds {problem}: "
                                 f"{values.flatten()[:3].tolist()}")
        with self._lock:
            for name in self._FIELDS:
                getattr(self, name).copy_(state[name])
            self.n_added[0] = n_added


def _describe(value):
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} {tuple(value.shape)}"
    return type(value).__name__
