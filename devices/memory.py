"""How many groups one forward/backward pass of the trainer may hold on a GPU: a memory model of
the activations, the output layer's chunk, the gradients and AdamW's moments (`trainer.train_step`
asks when --micro-groups is 0, a GPU's default)."""
import torch


# The memory model of a pass, fitted to `bench/memory.py predict`'s measurements of a 1.1B Llama
# (bench/README.md): the activations kept for backward, per layer and trained token, are about
# this many bytes per hidden unit (the residual stream, attention and MLP inputs and outputs).
ACTIVATION_BYTES = {torch.float32: 76, torch.bfloat16: 54, torch.float16: 54}
LOGIT_CHUNK = 64          # positions of the output layer at once (logprobs.completion_logprobs)


def groups_per_pass(model, optimizer, batch, dtype):
    """How many groups one forward/backward pass may hold, when the step was not told
    (--micro-groups 0). On a CPU: all of them. On a GPU, a pass per group costs host time (its
    launches, its casts): all of them when the memory model says they fit in what the GPU has
    free, else as many as fit (at least one). Free memory is read from the driver, which does
    not wait for the GPU to finish its work.                                       -> int"""
    device = next(model.parameters()).device
    if device.type != "cuda":
        return batch.response_ids.shape[0]
    free = torch.cuda.mem_get_info(device)[0] + (torch.cuda.memory_reserved(device)
                                                 - torch.cuda.memory_allocated(device))
    return groups_that_fit(model, optimizer, batch, dtype, free)


def groups_that_fit(model, optimizer, batch, dtype, free):
    """The memory model: groups of `batch` one pass may hold in `free` bytes.       -> int"""
    b, k, r = batch.response_ids.shape
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    free -= 4 * params + (8 * params if not optimizer.state else 0)   # gradients, AdamW moments
    config = model.config
    per_layer = ACTIVATION_BYTES.get(dtype, 76) * config.hidden_size      # a token, a layer
    per_token = (config.num_hidden_layers * 4 * config.hidden_size + per_layer
                 if getattr(model, "checkpointed_layers", 0)
                 else config.num_hidden_layers * per_layer)
    logits = k * LOGIT_CHUNK * config.vocab_size * 4 * 3      # a chunk's logits and log-softmax
    per_group = k * (batch.prompt_ids.shape[1] + r) * per_token + logits
    return max(1, min(b, int(0.8 * free // per_group)))
