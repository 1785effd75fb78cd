"""The searcher: turn prompts into scored groups of completions.

`sample_groups` is one unit of search: K completions for each of B prompts from the current
policy, their rewards from the task, their log-probs under the frozen reference model. The
synchronous loop calls it in the trainer's process; a searcher process (`run`) calls it in a
loop with the newest weights and writes the groups to the shared replay buffer.
"""
import multiprocessing
import os
import signal
import traceback
from dataclasses import dataclass
from typing import Callable

import torch
from transformers.utils import logging as transformers_logging

from llm import models, precision
from devices import placement
from llm import sampling
import tasks
from batch import REFERENCE, GroupBatch
from llm.logprobs import group_logprobs
from devices.sync_check import receive_weights
from plumbing.errors import NonFiniteError, diverged_policy_named


@dataclass(frozen=True)
class SearchOptions:
    """Where options change a searcher, wired in where the run is assembled
    (`assembly.load.make_source`); None: the plain path.
    sample: generates the groups instead of `sampling.generate` at the trainer's temperature,
            (policy, ref_model, tokenizer, prompt ids, *, temperature, num_samples,
            max_new_tokens, stop_event) -> (`generate`'s five outputs, each group's temperature
            [B], whether the reference sampled it [B]) (options/exploration.py)
    adapt:  policy -> policy, before its first weights arrive (options/lora.py)"""
    sample: Callable | None = None
    adapt: Callable | None = None


@torch.no_grad()
def sample_groups(policy, ref_model, tokenizer, task, prompts, group_size, max_new_tokens,
                  temperature, version=0, stop_event=None, dtype=torch.float32, reference_pass=0,
                  sample=None):
    """Generate, score and reference-score one batch of groups.  -> (GroupBatch, completions)

    The batch carries log μ(y|x) of the distribution that sampled it, for the off-policy metrics
    however old the group is when trained on. With `sample` (`SearchOptions.sample`) a group
    may be sampled at a temperature of its own, or by the reference; its rewards and reference
    log-probs (scored at the trainer's `temperature`, `reference_pass` completions a pass, 0:
    all) do not depend on how it was sampled. Everything runs under the trainer's autocast
    `dtype`.
    """
    device = next(policy.parameters()).device
    ids = [p.ids for p in prompts]
    with precision.autocast(device, dtype), diverged_policy_named(version):
        if sample is None:                # every group by the policy at the trainer's temperature
            temperatures = torch.full((len(prompts),), float(temperature))           # [B]
            from_reference = torch.zeros(len(prompts), dtype=torch.bool)            # [B]
            generated = sampling.generate(
                policy, tokenizer, ids, num_samples=group_size, max_new_tokens=max_new_tokens,
                temperature=temperature, stop_event=stop_event, with_logprobs=True)
        else:
            generated, temperatures, from_reference = sample(
                policy, ref_model, tokenizer, ids, temperature=temperature,
                num_samples=group_size, max_new_tokens=max_new_tokens, stop_event=stop_event)
    prompt_ids, prompt_mask, response_ids, response_len, behaviour_logp = generated
    completions = sampling.decode(tokenizer, response_ids, response_len)       # B·K strings
    repeated = [p for p in prompts for _ in range(group_size)]
    reward, info = task.score(repeated, completions)
    reward = torch.tensor(reward, dtype=torch.float32)
    per_completion = (len(prompts), group_size)                                # [B, K]
    on = prompt_ids.device               # every tensor of the batch where the model is
    batch = GroupBatch(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
        response_len=response_len, reward=reward.view(per_completion).to(on),
        ref_logp=torch.zeros(per_completion, device=on),
        version=torch.where(from_reference, REFERENCE, version).long()[:, None].expand(per_completion).to(on),
        prompt_index=torch.tensor([p.index for p in prompts], dtype=torch.long, device=on),
        behaviour_logp=behaviour_logp,
        search_temperature=temperatures[:, None].expand(per_completion).to(on),
        from_reference=from_reference[:, None].expand(per_completion).to(on), info=info)
    if isinstance(info, dict) and "embeddings" in info:   # for the buffer's near-duplicate merge
        batch.embedding = torch.as_tensor(info["embeddings"]).view(len(prompts), group_size, -1)
    n_completions = len(prompts) * group_size
    size = reference_pass or n_completions
    with precision.autocast(device, dtype):
        ref_logp = [group_logprobs(ref_model, batch, temperature, completions=slice(s, s + size))
                    for s in range(0, n_completions, size)]                     # [size] each
    batch.ref_logp = torch.cat(ref_logp).view(len(prompts), group_size)       # [B, K]
    check_finite(batch, version)
    return batch, completions


def check_finite(batch, version):
    """Raise NonFiniteError if a sampled log μ, a reward or a reference log-prob of the batch is
    NaN or infinite: one such number in the buffer makes a loss NaN steps later, far from its
    cause, and a NaN log μ would read as "not recorded" to the off-policy statistics."""
    for name, values in (("log μ of the sampled completions", batch.behaviour_logp),
                         ("reward", batch.reward), ("reference log-prob", batch.ref_logp)):
        bad = ~torch.isfinite(values)                                          # [B, K]
        if bad.any():
            raise NonFiniteError(f"the {name} is not finite for {int(bad.sum())} of "
                                 f"{bad.numel()} completions (e.g. {values[bad][0].item()}), "
                                 f"sampled with the weights of version {version}")


def reference_pass_size(cfg):
    """Completions per no-grad pass of the reference: the trainer's micro-batch (0: all B·K at
    once), but at least a whole group. A no-grad pass keeps no activations for backward, so a
    gradient pass's --micro-completions would only split it into many small passes (the paper
    recipe's 140 completions would take 35 passes of 4, not 7 of 20)."""
    if cfg.micro_completions:
        return max(cfg.micro_completions, cfg.group_size)
    return cfg.micro_groups * cfg.group_size


class Searcher:
    """One searcher: the task, the policy it samples from, the frozen reference (the initial
    model, never changed) and its shard of the training prompts; a searcher process (`run`) or
    a Ray actor drives it. The policy gets the trainer's first weights (version 0, or a
    checkpoint's on resume) before `start`, which is given that version."""

    def __init__(self, rank, cfg, device, threads, options=SearchOptions()):
        self.placed = str(device)         # as placement gave it (cuda:1); `device`: its tensors'
        device = placement.set_up_process(device, threads)
        self.rank, self.cfg = rank, cfg
        self.task = tasks.make_task(cfg)
        self.policy, self.tokenizer = self.task.load_model(device)
        if options.adapt:
            options.adapt(self.policy)
        self.sample = options.sample
        self.dtype = getattr(torch, cfg.dtype)
        self.ref_model = models.frozen_copy(self.policy, self.dtype)
        self.reference_pass = reference_pass_size(cfg)
        self.prompt_batches = None

    def start(self, version):
        """Seed and pick the prompts, once the first weights (of `version`) are loaded."""
        cfg = self.cfg
        # One seed per (rank, starting version): searchers differ from each other and from the
        # trainer, and a resumed run does not replay the samples of its first session.
        seed = cfg.seed + 1 + self.rank + cfg.searchers * max(version, 0)
        torch.manual_seed(seed)
        train_prompts = self.task.prompts("train", self.tokenizer)
        # Each searcher draws from its own shard; with fewer prompts than searchers, from all.
        shard = (train_prompts[self.rank::cfg.searchers] if len(train_prompts) >= cfg.searchers
                 else train_prompts)
        self.prompt_batches = tasks.prompt_batches(shard, cfg.search_batch or cfg.prompts_per_step, seed)

    def search(self, version, stop_event=None):
        """One batch of groups from the current weights. -> (prompt ids, GroupBatch on the CPU,
        report: tokens and groups generated, the task's `score` info)"""
        prompts = next(self.prompt_batches)
        batch, _ = sample_groups(self.policy, self.ref_model, self.tokenizer, self.task, prompts,
                                 group_size=self.cfg.group_size,
                                 max_new_tokens=self.cfg.max_new_tokens,
                                 temperature=self.cfg.temperature, version=version,
                                 stop_event=stop_event, dtype=self.dtype,
                                 reference_pass=self.reference_pass, sample=self.sample)
        batch = batch.to("cpu")
        info, batch.info = batch.info, None
        report = {"rank": self.rank, "tokens": int(batch.response_len.sum()),
                  "groups": len(prompts), "info": info}
        return [p.ids for p in prompts], batch, report


def run(rank, cfg, device, threads, buffer, weights, reports, stop, options=SearchOptions()):
    """One searcher process: load, then search with the newest weights until told to stop; each
    batch goes to the shared buffer, its report (or a traceback) to the trainer."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # Ctrl-C is the trainer's to handle: it stops us
    transformers_logging.disable_progress_bar()     # the trainer's bars are the ones to watch
    placement.die_with_parent()
    parent = multiprocessing.parent_process().pid   # the trainer, even if it is already gone
    try:
        searcher = Searcher(rank, cfg, device, threads, options)
        version = receive_weights(searcher, weights, -1, reports, block=True)
        searcher.start(version)
        while not stop.is_set() and os.getppid() == parent:   # never outlive the trainer
            version = receive_weights(searcher, weights, version, reports)
            prompt_ids, batch, report = searcher.search(version, stop)
            if stop.is_set():                 # generation was cut short: not a real group
                break
            buffer.add_batch(prompt_ids, batch)
            reports.put(report)
    except NonFiniteError as e:       # the run stops on it: a reason, not a traceback
        reports.put({"rank": rank, "error": str(e), "reason": True})
    except BaseException:
        reports.put({"rank": rank, "error": traceback.format_exc()})
        raise
