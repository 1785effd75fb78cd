"""How the replay buffer draws: the weights and the random picks behind `ReplayBuffer.sample`.

A drawn group is a prompt, then up to K of its completions. A `Pool` holds what one draw may
still take; `pick` draws a prompt with probability ∝ its weight (uniform, or `priority_weights`:
a softmax of the prompt's mean reward), `draw_without_replacement` its completions (uniform, or a
softmax of their rewards). The picks run in NumPy, under the buffer's lock, on views of its
shared tensors; `priority_weights` is a torch function (the one the notebooks' assignment asks
for), which `Pool` calls on those views.
"""
import numpy as np
import torch


def pick(weights, rng, cdf=None):
    """One index drawn with probability ∝ weights ([n] float64 >= 0, NumPy) by inverting their
    CDF; `rng`: a NumPy Generator. `cdf`: that of earlier weights, some since set to 0: a draw
    landing on one of those is drawn again (rejection: exactly the renormalised distribution,
    without a new cumulative sum per group). -> (index, the CDF to pass next time)"""
    for attempt in range(8):
        if cdf is None or attempt == 7:
            cdf = np.cumsum(weights)                                           # [n]
        i = int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), len(cdf) - 1))
        if weights[i] > 0:
            return i, cdf


def priority_weights(group_reward, available, priority_temp) -> torch.Tensor:
    """Softmax numerators exp(reward / priority_temp) of the available entries, 0 for the
    others. Shifted so that the best available one weighs exactly 1: nothing overflows, and
    however small priority_temp is, the weights of what is left never all underflow to 0.
    group_reward: [n] float64 mean reward of each prompt's completions; available: [n] bool. -> [n]"""
    logits = group_reward / priority_temp                                      # [n]
    return torch.where(available, (logits - logits[available].max()).exp(), 0.0)


def draw_without_replacement(log_weights, k, rng):
    """k distinct indices drawn one after another with probability ∝ exp(log_weights) among
    those not drawn yet (Plackett-Luce), all at once: the top k of log_weights + Gumbel noise.
    log_weights: [n] float64, NumPy (all 0: a uniform draw); rng: a NumPy Generator. -> [min(k, n)]"""
    keys = log_weights + rng.gumbel(size=len(log_weights))                     # [n]
    return np.argsort(-keys, kind="stable")[:k]


def groups_in(counts, group_size) -> int:
    """How many groups of at most K and at least 2 completions `counts` [N] completions per
    prompt make, drawn K at a time (what `sample` can always draw)."""
    return int((counts // group_size + (counts % group_size >= 2)).sum())


class Pool:
    """What a draw may take (NumPy, under the buffer's lock): the completions (`mask` [C]), how
    many of them each prompt has (`left` [N]), and each prompt's weight [N]: uniform, or
    ∝ exp(mean reward / priority_temp) with `prompt_reward`; 0 with fewer than 2 left.
    A drawn-out prompt's weight goes to 0 and the rest keep theirs, only renormalised: a
    Plackett-Luce draw of prompts."""

    def __init__(self, mask, left, prompt_reward=None, priority_temp=None):
        self.mask, self.left = mask, left                                      # [C], [N]
        self.prompt_reward, self.priority_temp = prompt_reward, priority_temp  # [N] or None
        self.weight, self.cdf = None, None                                     # [N], [N]
        self.reweigh()

    def reweigh(self):
        if self.prompt_reward is None:
            self.weight = (self.left >= 2).astype(np.float64)
        else:
            self.weight = priority_weights(torch.from_numpy(self.prompt_reward),
                                           torch.from_numpy(self.left >= 2),
                                           self.priority_temp).numpy()
        self.cdf = None

    def pick_prompt(self, rng) -> int:
        if not self.weight.any():        # all that is left underflowed: shift again
            self.reweigh()
        prompt, self.cdf = pick(self.weight, rng, self.cdf)
        return prompt

    def take(self, prompt, slots):
        """Completions `slots` [k] of `prompt` were drawn: out of this pool."""
        self.left[prompt] -= self.mask[slots].sum()
        self.mask[slots] = False
        if self.left[prompt] < 2:
            self.weight[prompt] = 0.0
