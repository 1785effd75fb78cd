"""A batch of groups: B prompts with up to K completions each, the unit that flows from the
searcher through the replay buffer to the trainer. Every per-completion tensor is [B, K].
"""
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
