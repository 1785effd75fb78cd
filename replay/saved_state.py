"""The check of a replay buffer's saved state before it is loaded: what a checkpoint holds of
the buffer (`ReplayBuffer.state_dict`) is read back on `--resume`, and is refused, with what is
wrong, unless this buffer could have written it."""
import torch


def check(slots, state, versions):
    """A replay buffer's saved state (`ReplayBuffer.state_dict`) could have come from the buffer
    `slots`, with weight versions in `versions` (lowest, highest: the reference's, the
    checkpoint's step): a file with the right shapes but impossible values would otherwise be
    trained on, or crash a searcher much later. Raises ValueError saying what is wrong."""
    lowest, highest = versions
    if "keep" in state or getattr(state.get("response_ids"), "dim", lambda: 2)() == 3:
        raise ValueError("the checkpoint's replay buffer holds whole groups, and this buffer "
                         "stores completions: it cannot be loaded; start the run again")
    for name in slots.FIELDS:
        if name not in state:
            raise ValueError(f"buffer state_dict is missing '{name}'")
        want, got = getattr(slots, name), state[name]
        if (not isinstance(got, torch.Tensor) or got.shape != want.shape
                or got.dtype != want.dtype):
            raise ValueError(
                f"buffer state_dict '{name}' is {_describe(got)} but this buffer expects "
                f"{_describe(want)} (capacity={slots.capacity}, n_prompts={slots.n_prompts}, "
                f"max_prompt_len={slots.max_prompt_len}, "
                f"max_response_len={slots.max_response_len})")
    n_added = state.get("n_added")
    if not isinstance(n_added, int) or n_added < 0:
        raise ValueError(f"buffer state_dict 'n_added' must be a count >= 0, got {n_added!r}")
    stored = state["prompt_index"] >= 0                                    # [C]
    filled = {name: state[name][stored] for name in (
        "response_len", "reward", "ref_logp", "behaviour_logp", "version", "prompt_index",
        "order", "draws")}
    seen = state["prompt_len"][filled["prompt_index"].clamp(0, slots.n_prompts - 1)]
    rules = [  # (what is wrong, the offending values) for the stored completions
        (f"versions outside [{lowest}, {highest}]",
         filled["version"][(filled["version"] < lowest) | (filled["version"] > highest)]),
        (f"prompt indices outside [0, {slots.n_prompts})",
         filled["prompt_index"][filled["prompt_index"] >= slots.n_prompts]),
        (f"prompt lengths outside [1, {slots.max_prompt_len}]",
         seen[(seen < 1) | (seen > slots.max_prompt_len)]),
        (f"response lengths outside [1, {slots.max_response_len}]",
         filled["response_len"][(filled["response_len"] < 1)
                                | (filled["response_len"] > slots.max_response_len)]),
        ("non-finite rewards", filled["reward"][~filled["reward"].isfinite()]),
        ("non-finite reference log-probs", filled["ref_logp"][~filled["ref_logp"].isfinite()]),
        ("infinite behaviour log-probs", filled["behaviour_logp"][
            filled["behaviour_logp"].isinf()]),
        ("negative draw counts", filled["draws"][filled["draws"] < 0]),
        (f"insertion orders outside [0, {n_added})",
         filled["order"][(filled["order"] < 0) | (filled["order"] >= n_added)]),
    ]
    for problem, values in rules:
        if values.numel():
            raise ValueError(f"buffer state_dict holds {problem}: "
                             f"{values.flatten()[:3].tolist()}")


def _describe(value):
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} {tuple(value.shape)}"
    return type(value).__name__
