"""A batch of groups: B prompts with up to K completions each, the unit that flows from the
searcher through the replay buffer to the trainer. Every per-completion tensor is [B, K].
"""
import math
from dataclasses import dataclass, fields
from typing import Optional

import torch

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

    def to(self, device, non_blocking=False) -> "GroupBatch":
        """The batch on `device`. `non_blocking` from the CPU to a GPU: each tensor is copied
        into page-locked memory first, so the copy to the GPU runs without the host waiting."""
        pin = non_blocking and torch.device(device).type == "cuda"

        def moved(v):
            if pin and v.device.type == "cpu":
                v = v.pin_memory()
            return v.to(device, non_blocking=non_blocking)
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return GroupBatch(**{name: moved(v) if isinstance(v, torch.Tensor) else v
                             for name, v in values.items()})

    def host_lengths(self):
        """What decides the shapes of the passes over this batch, as Python ints, read in one
        transfer (free when the batch is on the CPU): each completion's length, 0 where it is
        not kept, and each prompt's length.                          -> ([B][K] list, [B] list)"""
        lengths = torch.cat([torch.where(self.kept(), self.response_len, 0),       # [B, K]
                             self.prompt_mask.sum(1, keepdim=True)], 1).tolist()   # [B, K + 1]
        return [row[:-1] for row in lengths], [row[-1] for row in lengths]

    def groups(self, rows) -> "GroupBatch":
        """The groups at `rows` (a slice or [n] indices) as a batch of their own, without the
        fields only a whole fresh search has (info)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return GroupBatch(**{name: v[rows] if isinstance(v, torch.Tensor) else v
                             for name, v in values.items() if name != "info"})

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

    def sampling_metrics(self, version):
        """How the completions of a step were sampled, counting only those trained on: how many
        updates behind `version` (the trainer's) the policy's own samples are, the share the
        reference sampled (of no version: never stale), and their mean temperature.  -> dict"""
        kept = self.kept()                                                        # [B, K]
        metrics = {"trained_completions": int(kept.sum())}
        by_policy = kept & (self.version != REFERENCE)                            # [B, K]
        if by_policy.any():
            staleness = (version - self.version[by_policy]).float()               # [n]
            metrics.update(staleness_mean=staleness.mean().item(),
                           staleness_max=staleness.max().item())
        if self.from_reference is not None:
            metrics["from_reference_frac"] = self.from_reference[kept].float().mean().item()
        if self.search_temperature is not None and not self.search_temperature[kept].isnan().all():
            metrics["search_temperature_mean"] = self.search_temperature[kept].nanmean().item()
        return metrics
