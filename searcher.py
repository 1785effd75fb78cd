"""The searcher: turn prompts into scored groups of completions.

`sample_groups` is one unit of search: K completions for each of B prompts from the current
policy, their rewards from the task, and their log-probs under the frozen reference model. The
synchronous loop calls it in the trainer's process; asynchronous searchers call it in a loop in
their own processes and write the groups to the replay buffer.
"""
import random

import torch

import models
from buffer import GroupBatch
from trainer import group_inputs, sequence_logprobs


def prompt_batches(prompts, batch_size, seed):
    """Endless batches of prompts: each epoch is a fresh shuffle, so all are seen equally."""
    rng = random.Random(seed)
    order = []
    while True:
        batch = []
        while len(batch) < batch_size:
            if not order:
                order = list(prompts)
                rng.shuffle(order)
            batch.append(order.pop())
        yield batch


@torch.no_grad()
def sample_groups(policy, ref_model, tokenizer, task, prompts, group_size, max_new_tokens,
                  temperature, version=0):
    """Generate, score and reference-score one batch of groups.  -> (GroupBatch, completions)"""
    prompt_ids, prompt_mask, response_ids, response_len = models.generate(
        policy, tokenizer, [p.ids for p in prompts], num_samples=group_size,
        max_new_tokens=max_new_tokens, temperature=temperature)              # [B, K, R], [B, K]
    completions = models.decode(tokenizer, response_ids, response_len)       # B·K strings
    repeated = [p for p in prompts for _ in range(group_size)]
    reward = torch.tensor(task.reward(repeated, completions), dtype=torch.float32)
    batch = GroupBatch(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
        response_len=response_len, reward=reward.view(len(prompts), group_size).to(prompt_ids.device),
        ref_logp=torch.zeros(len(prompts), group_size, device=prompt_ids.device),
        version=torch.full((len(prompts),), version, dtype=torch.long),
        prompt_index=torch.tensor([p.index for p in prompts], dtype=torch.long))
    batch.ref_logp = sequence_logprobs(ref_model, *group_inputs(batch),
                                       temperature).view(len(prompts), group_size)
    return batch, completions
