"""Explorative search: groups sampled at a temperature of their own, or by the frozen reference.

`--search-temperature LOW HIGH` draws each group's temperature from U(LOW, HIGH) (only a share
`--search-temperature-frac` of the groups, the others at --temperature); `--reference-frac p`
has the reference sample a group instead of the policy with probability p. `from_config` gives
the run's `Exploration`, which `assembly.load.make_source` hands every searcher as its sampler
(`searcher.SearchOptions.sample`). The batch records both per group, and each completion's
log μ is that of the distribution that really sampled it: TB's fixed point does not depend on
who sampled (trainer.tb_loss).
"""
from dataclasses import dataclass

import torch

from llm import sampling
from plumbing.flags import flag, within


@dataclass
class Settings:
    """exploration (options/exploration.py): how the searchers sample"""
    search_temperature: list = flag(None, "LOW HIGH: sample each group at a temperature drawn "
                                          "uniformly from [LOW, HIGH] (GFlowNet red-teaming: 0.5 "
                                          "2.0) instead of --temperature; the trainer still "
                                          "scores at --temperature; off by default",
                                    ((lambda v: 0 < v[0] <= v[1]), "two numbers 0 < LOW <= HIGH"))
    reference_frac: float = flag(0.0, "share of groups sampled by the frozen reference model "
                                      "instead of the policy", within(0, 1))
    search_temperature_frac: float = flag(1.0, "with --search-temperature: the share of groups "
                                               "sampled at a drawn temperature, the others at "
                                               "--temperature (GFlowNet red-teaming: 0.5)",
                                          ((lambda v: 0 < v <= 1), "in (0, 1]"))


def check(cfg):
    """The rules that tie exploration's settings to the others."""
    if cfg.search_temperature_frac < 1 and not cfg.search_temperature:
        raise ValueError(f"--search-temperature-frac {cfg.search_temperature_frac} is the share "
                         "of groups sampled at a drawn temperature, and --search-temperature "
                         "is not set: add --search-temperature LOW HIGH, or drop it")


@dataclass(frozen=True)
class Exploration:
    """A searcher's sampler with exploration (`searcher.SearchOptions.sample`): each group's
    temperature and sampler drawn by `temperatures_and_samplers`, then generated."""
    search_temperature: tuple | None = None    # (LOW, HIGH), or None: --temperature
    reference_frac: float = 0.0                # the chance that the reference samples a group
    explore_frac: float = 1.0                  # the share of groups at U(LOW, HIGH)

    def __call__(self, policy, ref_model, tokenizer, prompt_ids, *, temperature, **kwargs):
        """-> (`generate(with_logprobs=True)`'s five outputs, temperatures [B], from_reference
        [B]); kwargs: `generate`'s num_samples, max_new_tokens, stop_event."""
        temperatures, from_reference = temperatures_and_samplers(
            len(prompt_ids), temperature, self.search_temperature, self.reference_frac,
            self.explore_frac)                                                   # [B], [B]
        temperature = temperatures if self.search_temperature else temperature
        if from_reference.any():
            generated = generate_with_reference(policy, ref_model, tokenizer, prompt_ids,
                                                from_reference, temperature=temperature, **kwargs)
        else:
            generated = sampling.generate(policy, tokenizer, prompt_ids, temperature=temperature,
                                          with_logprobs=True, **kwargs)
        return generated, temperatures, from_reference


def from_config(cfg):
    """The run's Exploration, or None when it sets neither --search-temperature nor
    --reference-frac."""
    if not cfg.search_temperature and not cfg.reference_frac:
        return None
    return Exploration(cfg.search_temperature, cfg.reference_frac, cfg.search_temperature_frac)


def temperatures_and_samplers(n_groups, temperature, search_temperature=None, reference_frac=0.0,
                              explore_frac=1.0):
    """How each of n groups is sampled: its temperature, U(LOW, HIGH) per group with
    `search_temperature` = (LOW, HIGH), else `temperature` (with `explore_frac` < 1 each group
    is drawn from U(LOW, HIGH) with that probability, else at `temperature`: GFlowNet
    red-teaming's half at U(0.5, 2), half at 1); and whether the frozen reference samples it
    instead of the policy, with probability `reference_frac`. Random numbers are drawn only for
    what is asked: a run without exploration consumes none here.
    -> temperatures [n] float32, from_reference [n] bool"""
    if search_temperature:
        low, high = search_temperature
        temperatures = low + (high - low) * torch.rand(n_groups)                 # [n]
        if explore_frac < 1:
            temperatures = torch.where(torch.rand(n_groups) < explore_frac, temperatures,
                                       float(temperature))                        # [n]
    else:
        temperatures = torch.full((n_groups,), float(temperature))               # [n]
    from_reference = (torch.rand(n_groups) < reference_frac if reference_frac
                      else torch.zeros(n_groups, dtype=torch.bool))              # [n]
    return temperatures, from_reference


def generate_with_reference(policy, ref_model, tokenizer, prompt_ids, from_reference, *,
                            temperature, **kwargs):
    """`sampling.generate` of each prompt by the policy, or by the reference where
    `from_reference` [B] says so: one call per model, the rows then put back in order.
    temperature: a number, or [B]. -> the five outputs of `generate(with_logprobs=True)`"""
    parts, order = [], []
    for model, rows in ((policy, ~from_reference), (ref_model, from_reference)):
        if rows.any():
            parts.append(sampling.generate(
                model, tokenizer, [p for p, r in zip(prompt_ids, rows) if r],
                temperature=temperature[rows] if isinstance(temperature, torch.Tensor)
                else temperature, with_logprobs=True, **kwargs))
            order.append(rows.nonzero().flatten())
    if len(parts) == 1:
        return parts[0]
    return concat_generations(parts, order=torch.cat(order), pad_id=tokenizer.pad_token_id)


def concat_generations(parts, order, pad_id):
    """The outputs of several `generate(..., with_logprobs=True)` calls as one, row i of the
    result being row order.argsort()[i] of the parts stacked: prompts re-padded on the left,
    responses on the right, to the widest.  parts: tuples (prompt_ids, prompt_mask [b, P],
    response_ids [b, n, R], response_len, behaviour_logp [b, n]); order: [B], the batch row of
    each stacked row.  -> the same five, [B, ...]"""
    width = max(part[0].shape[1] for part in parts)
    length = max(part[2].shape[2] for part in parts)
    left = lambda t, value: torch.nn.functional.pad(t, (width - t.shape[1], 0), value=value)
    right = lambda t: torch.nn.functional.pad(t, (0, length - t.shape[2]), value=pad_id)
    stacked = (torch.cat([left(part[0], pad_id) for part in parts]),            # [B, P]
               torch.cat([left(part[1], 0) for part in parts]),                 # [B, P]
               torch.cat([right(part[2]) for part in parts]),                   # [B, n, R]
               torch.cat([part[3] for part in parts]),                          # [B, n]
               torch.cat([part[4] for part in parts]))                          # [B, n]
    back = order.argsort().to(stacked[0].device)
    return tuple(t[back] for t in stacked)
