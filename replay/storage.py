"""What the replay buffer keeps, and what it lets go: its storage policies, and the checks of
what it is given.

`store` puts one searched completion into a slot (called by `ReplayBuffer.add`, under its lock):
- `dedup`: an exact copy of a stored completion of the prompt replaces it in place;
- `merge_cosine`: a near-duplicate (embeddings with cosine >= merge_cosine) is kept only if it
  is better than the near ones stored, which then make way for it;
- when the buffer, or the prompt's share of it (`per_prompt`), is full, `slot_to_replace`
  picks the oldest completion (``evict="oldest"``) or the lowest reward (``"lowest"``: the
  best stay however old they are).
"""
from dataclasses import dataclass

import numpy as np
import torch

from plumbing.flags import flag, within


@dataclass
class Settings:
    """the replay buffer's storage (replay/storage.py)"""
    dedup: bool = flag(False, "store each completion of a prompt once: its newest copy (older "
                              "copies in the buffer are left out); needs --max-reuse 0")
    merge_cosine: float = flag(0.0, "redteam: completions of a prompt whose embeddings have "
                                    "cosine at least this are near-duplicates, of which the "
                                    "buffer keeps the higher reward (0: off)", within(0, 1))


def check(cfg):
    """--dedup and --merge-cosine act on a replay buffer that may run out of new groups."""
    for name, on in (("--dedup", cfg.dedup), ("--merge-cosine", cfg.merge_cosine)):
        if on and not (cfg.searchers or cfg.replay_groups):
            raise ValueError(f"{name} acts on the replay buffer, and --searchers 0 has none: "
                             "use --searchers 1 or more, or --replay-groups, or drop it")
        if on and cfg.max_reuse:
            raise ValueError(f"{name} with --max-reuse {cfg.max_reuse}: a buffer that stores "
                             "what was found once would run out of groups to draw once the "
                             "searchers find nothing new: use --max-reuse 0")


class Storage:
    """The storage policies of a `ReplayBuffer` and the checks of what it is given: a part the
    buffer holds (`buffer.storage`) and calls under its lock. Its methods read and write the
    buffer's shared tensors (`slots`: the buffer, whose fields `response_ids`, `reward`,
    `order`, ... they are), and call nothing of it back."""

    def __init__(self, slots, per_prompt=0, evict="oldest", dedup=False, merge_cosine=0.0):
        """per_prompt: at most this many completions of one prompt (0: no bound but the
        capacity); evict, dedup, merge_cosine: as the module says."""
        self.check_policy(per_prompt, evict, merge_cosine, slots.embedding.shape[1])
        self.slots = slots
        self.per_prompt, self.evict = per_prompt or slots.capacity, evict
        self.dedup, self.merge_cosine = dedup, merge_cosine

    def next_order(self) -> int:
        """The insertion order of the completion stored now: 0, 1, 2, ... over the buffer's
        life (under the lock)."""
        n = int(self.slots.n_added[0])
        self.slots.n_added[0] = n + 1
        return n

    def store(self, prompt_index, tokens, length, completion, embedding) -> bool:
        """Store one completion (under the lock). -> whether it was stored

        dedup: an exact copy of a stored completion of the prompt replaces it in place (the
        newest copy is kept, with its own version and log μ). merge_cosine: if stored
        completions of the prompt are near it, the best of them is kept if it is at least as
        good, and counts as found again (its age is renewed, so "oldest" eviction cannot take
        what keeps being rediscovered); else they all make way for it."""
        slots = self.slots
        index = slots.prompt_index.numpy()                                     # [C]
        mine = torch.from_numpy(np.flatnonzero(index == prompt_index))         # [m]
        slot = None
        if self.dedup:
            same = mine[(slots.response_len[mine] == length)
                        & (slots.response_ids[mine] == tokens).all(1)]          # [0 or 1]
            slot = int(same[0]) if len(same) else None
        if slot is None and self.merge_cosine:
            is_near = slots.embedding[mine] @ embedding >= self.merge_cosine    # [m]
            near = mine[is_near]
            if len(near):
                best = int(near[slots.reward[near].argmax()])
                if slots.reward[best] >= completion["reward"]:
                    slots.order[best] = self.next_order()
                    return False
                slots.prompt_index[near] = -1                                   # made way
                mine = mine[~is_near]
        if slot is None:
            slot = self.slot_to_replace(mine, completion["reward"])
            if slot is None:
                return False
        slots.response_ids[slot], slots.response_len[slot] = tokens, length
        for name, value in completion.items():
            getattr(slots, name)[slot] = value
        if self.merge_cosine:
            slots.embedding[slot] = embedding
        slots.prompt_index[slot], slots.order[slot] = prompt_index, self.next_order()
        slots.draws[slot] = 0
        return True

    def slot_to_replace(self, mine, reward) -> int | None:
        """The slot a new completion of reward `reward` goes to (under the lock): a free one,
        or one whose completion is evicted. `mine` [m]: the slots of its prompt. A prompt at
        `per_prompt` evicts one of its own; a full buffer evicts the oldest of all ("oldest"),
        or ("lowest") the lowest reward of the prompt holding the most. Among equal rewards the
        oldest goes. -> None when "lowest" finds the new one worse than all its prompt holds."""
        slots = self.slots
        index = slots.prompt_index.numpy()                                      # [C]
        own = len(mine) >= self.per_prompt
        if not own and (index < 0).any():
            return int((index < 0).argmax())                                   # the first free
        if own:
            candidates = mine
        elif self.evict == "oldest":                                           # of all stored
            order = np.where(index >= 0, slots.order.numpy(), np.iinfo(np.int64).max)  # [C]
            return int(order.argmin())
        else:
            largest = np.bincount(index[index >= 0], minlength=slots.n_prompts).argmax()
            own = largest == slots.prompt_index[mine[0]] if len(mine) else False
            candidates = torch.from_numpy(np.flatnonzero(index == largest))
        if self.evict == "lowest":
            lowest = slots.reward[candidates].min()
            if own and reward < lowest:
                return None
            candidates = candidates[slots.reward[candidates] == lowest]
        return int(candidates[slots.order[candidates].argmin()])

    @staticmethod
    def check_policy(per_prompt, evict, merge_cosine, embedding_dim):
        """The storage policy's settings (`ReplayBuffer`'s arguments) make sense."""
        if evict not in ("oldest", "lowest"):
            raise ValueError(f"evict must be 'oldest' or 'lowest', got {evict!r}")
        if per_prompt < 0 or 0 < per_prompt < 2:
            raise ValueError(f"per_prompt must be 0 (no bound) or >= 2, got {per_prompt}")
        if merge_cosine and (not 0 < merge_cosine <= 1 or embedding_dim < 1):
            raise ValueError(f"merge_cosine must be in (0, 1] with embedding_dim >= 1, got "
                             f"{merge_cosine} and {embedding_dim}")

    def check_group(self, prompt, resp, lens, per_completion, prompt_index, embedding):
        """A group given to `ReplayBuffer.add` fits the buffer; ValueError saying how it does
        not."""
        slots = self.slots
        P, R = slots.max_prompt_len, slots.max_response_len
        k = resp.shape[0] if resp.dim() == 2 else -1
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
        if not 0 <= prompt_index < slots.n_prompts:
            raise ValueError(f"prompt_index must be in [0, n_prompts={slots.n_prompts}), got "
                             f"{prompt_index}")
        if self.merge_cosine and embedding is None:
            raise ValueError("this buffer merges near-duplicates: add needs the embeddings")
