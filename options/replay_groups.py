"""--replay-groups n: the synchronous loop training on fresh and replayed groups together (GFlowNet
red-teaming's loop: half fresh, half replayed).

Each step samples B − n groups fresh and trains on them beside n groups drawn from a replay
buffer of the completions earlier steps sampled (by --priority-temp, within --max-staleness and
--max-reuse), then stores the fresh ones in it (as --buffer-evict, --dedup, --merge-cosine say).
Every fresh completion is trained on once, as in the on-policy loop, then on each replay
(--max-reuse counts the replays); until earlier steps have stored n groups, all B are fresh.

Two options of GFlowNet red-teaming's loop: --search-factor f samples f × (B − n) fresh groups a
step, as f searchers would, trains on B − n of them and stores them all (more search per
update); --seed-buffer N fills the buffer, before the first step, with N groups the frozen
reference samples, after the task's demonstrations (`Task.demonstrations`: red-teaming's
human-written attacks), each scored by the task and by the reference as a sampled one is.
"""
import math
from dataclasses import dataclass

import torch

from batch import REFERENCE, GroupBatch
from engines.sources import SynchronousSource
from llm import precision, sampling
from llm.logprobs import completion_logprobs
from options import exploration
from plumbing.flags import at_least, flag


@dataclass
class Settings:
    """replay in the synchronous loop (options/replay_groups.py)"""
    replay_groups: int = flag(0, "--searchers 0 only: of each step's B groups, this many are "
                                 "drawn from a replay buffer of the completions earlier steps "
                                 "sampled (by --priority-temp; stored as --buffer-evict, "
                                 "--dedup, --merge-cosine say), the others sampled fresh, as "
                                 "GFlowNet red-teaming trains (0: on-policy only)", at_least(0))
    search_factor: int = flag(1, "--replay-groups only: each step samples this many times the "
                                 "fresh groups it trains on, as that many searchers would; the "
                                 "surplus goes to the replay buffer only (1: none)", at_least(1))
    seed_buffer: int = flag(0, "--replay-groups only: before the first step, this many groups "
                               "sampled by the frozen reference, scored and stored in the replay "
                               "buffer (GFlowNet red-teaming seeds its buffer; counted as "
                               "searched groups)", at_least(0))


def check(cfg):
    """Replay in the synchronous loop: beside fresh groups, and without another source of
    staleness."""
    if cfg.replay_groups and cfg.searchers:
        raise ValueError(f"--replay-groups {cfg.replay_groups} replays in the synchronous loop, "
                         f"but --searchers {cfg.searchers} already trains from a replay buffer: "
                         "set its share of fresh groups with --recent-frac, or use --searchers 0")
    if cfg.replay_groups >= cfg.prompts_per_step:
        raise ValueError(f"--replay-groups {cfg.replay_groups} leaves no fresh group of the "
                         f"--prompts-per-step {cfg.prompts_per_step}: use fewer")
    for name, on in (("--search-factor", cfg.search_factor > 1),
                     ("--seed-buffer", cfg.seed_buffer)):
        if on and not cfg.replay_groups:
            raise ValueError(f"{name} fills the synchronous loop's replay buffer, and "
                             "--replay-groups is 0: add --replay-groups N, or drop it")
    if cfg.replay_groups and cfg.lag:
        raise ValueError(f"--replay-groups with --lag {cfg.lag}: a lag sweep measures staleness "
                         "without replay: drop one of them")


class ReplayGroups(SynchronousSource):
    """The synchronous source, its batches topped up with groups replayed from `buffer`."""

    def __init__(self, cfg, task, policy, ref_model, tokenizer, prompts, buffer, lag=None,
                 sample=None):
        super().__init__(cfg, task, policy, ref_model, tokenizer, prompts, lag=lag, sample=sample)
        self.buffer = buffer
        self.replay_sampler = torch.Generator().manual_seed(cfg.seed)
        self.seeded = False               # --seed-buffer done (a resumed run has its buffer)
        # --seed-buffer's groups: every one sampled by the reference
        self.by_reference = exploration.Exploration(cfg.search_temperature, 1.0,
                                                    cfg.search_temperature_frac)

    def fill(self, progress=None):
        """--seed-buffer N: N groups sampled by the frozen reference at --temperature (version
        REFERENCE), scored and stored, B at a time, before the first step."""
        cfg, stored = self.cfg, 0
        if not self.seeded:
            pairs = self.task.demonstrations(self.train_prompts)
            if pairs:
                kept = store_demonstrations(self.buffer, self, pairs)
                self.groups += math.ceil(len(pairs) / cfg.group_size)   # victim queries
                print(f"tba: seeded the replay buffer with {len(pairs)} demonstrations, scored "
                      f"({kept} kept: the buffer holds {len(self.buffer)} completions)", flush=True)
        while not self.seeded and stored < cfg.seed_buffer:
            n = min(cfg.prompts_per_step, cfg.seed_buffer - stored)
            batch, _ = super().next_batch(0, n, sample=self.by_reference)
            self.buffer.add_batch([p.ids for p in self.last_prompts], batch.to("cpu"))
            stored += n
        self.seeded = True

    def next_batch(self, version):
        cfg = self.cfg
        replayed = self.replay(version)                   # n groups of earlier steps, or None
        n_fresh = cfg.prompts_per_step - (0 if replayed is None else cfg.replay_groups)
        searched, metrics = super().next_batch(version, n_fresh * cfg.search_factor)
        self.buffer.add_batch([p.ids for p in self.last_prompts], searched.to("cpu"))
        fresh = searched if cfg.search_factor == 1 else searched.groups(slice(0, n_fresh))
        fresh.recent_count = n_fresh                      # the fresh groups
        if replayed is not None:          # trained once fresh, outside the buffer's count
            replayed.draws = replayed.draws + 1           # [n, K] times trained
        batch = concatenated([fresh] if replayed is None else [fresh, replayed],
                             pad_id=self.tokenizer.pad_token_id)
        metrics.update(reuse_mean=batch.draws[batch.kept()].float().mean().item(),
                       buffer_completions=len(self.buffer),
                       recent_frac_actual=n_fresh / cfg.prompts_per_step,
                       **batch.sampling_metrics(version))
        return batch, metrics

    def replay(self, version):
        """n groups drawn from the completions earlier steps stored (by --priority-temp; none
        older than --max-staleness or drawn --max-reuse times), or None while the buffer holds
        fewer than n such groups."""
        cfg = self.cfg
        min_version = version - cfg.max_staleness if cfg.max_staleness >= 0 else -1
        if self.buffer.drawable_groups(min_version, cfg.max_reuse) < cfg.replay_groups:
            return None
        return self.buffer.sample(cfg.replay_groups, recent_frac=0.0,
                                  priority_temp=cfg.priority_temp or None,
                                  generator=self.replay_sampler, min_version=min_version,
                                  max_reuse=cfg.max_reuse)

    def state_dict(self):
        return {**super().state_dict(), "buffer": self.buffer.state_dict(),
                "sampler": self.replay_sampler.get_state(), "seeded": self.seeded}

    def load_state_dict(self, state, step):
        super().load_state_dict(state, step)
        if "buffer" in state:
            self.buffer.load_state_dict(state["buffer"], max_version=step)
            self.replay_sampler.set_state(state["sampler"])
            self.seeded = state.get("seeded", True)


@torch.no_grad()
def store_demonstrations(buffer, source, pairs, chunk=64):
    """Store (prompt, text) pairs in `buffer` as the reference's completions (version REFERENCE:
    never stale; no behaviour log-prob), each ended by EOS, rewarded by `source.task.score` and
    with its log-prob under `source.ref_model`, `chunk` at a time. -> how many were stored"""
    task, tokenizer, cfg = source.task, source.tokenizer, source.cfg
    device = next(source.ref_model.parameters()).device
    stored = 0
    for s in range(0, len(pairs), chunk):
        prompts, texts = zip(*pairs[s:s + chunk])
        rewards, info = task.score(list(prompts), list(texts))
        responses, lengths = sampling.ended_by_eos(
            tokenizer(list(texts), add_special_tokens=False)["input_ids"],
            tokenizer.eos_token_id)                                           # [m, R], [m]
        unique = list({p.index: p for p in prompts}.values())                   # [n] prompts
        owner = torch.tensor([[p.index for p in unique].index(p.index) for p in prompts])
        prompt_ids, prompt_mask = sampling.left_pad([p.ids for p in unique],
                                                    tokenizer.pad_token_id)     # [n, P] each
        with precision.autocast(device, getattr(torch, cfg.dtype)):
            ref_logp = completion_logprobs(
                source.ref_model, prompt_ids.to(device), prompt_mask.to(device),
                responses.to(device), lengths.to(device), owner.to(device),
                cfg.temperature).cpu()                                            # [m]
        embeddings = torch.as_tensor(info["embeddings"]) if isinstance(info, dict) else None
        for row, prompt in enumerate(prompts):
            stored += buffer.add(prompt.ids, responses[row:row + 1, :lengths[row]],
                                 lengths[row:row + 1], rewards[row:row + 1],
                                 ref_logp[row:row + 1], math.nan, REFERENCE, prompt.index,
                                 math.nan, None if embeddings is None else embeddings[row:row + 1])
    return stored


def concatenated(batches, pad_id: int) -> GroupBatch:
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
