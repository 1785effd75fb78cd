"""Host work per step, counted on the CPU: the kernel-launching ops and the host syncs of one
decode step of a search call and of one trainer step, with `torch.profiler` on a tiny Llama.

    python bench/overhead.py                     # this checkout's code
    python bench/overhead.py --repo DIR          # another checkout's (e.g. a worktree of main)

Why on a CPU: a small model on a GPU is bound by what the host does per step, not by the card.
Each aten op that does arithmetic is one kernel launch on a GPU (a few µs of host time each), and
each host sync (reading a device value in Python: `.item()`, `int(t)`, `bool(t)`, boolean-mask
indexing, `.tolist()`) stops the host from queueing work until the device has caught up. Both
counts are the same whatever the device, so they are counted here, where the work is done.

What is counted:
- ops: the aten ops with no aten op inside them (those that do the work), minus those that only
  make a view or an empty tensor (no kernel on a GPU).
- syncs: `aten::_local_scalar_dense` (every `.item()`, `int`, `float`, `bool` of a tensor),
  `aten::nonzero` (boolean-mask indexing, `masked_select`, `torch.where` with one argument) and
  every `Tensor.tolist` / `Tensor.numpy` call (a copy to the host; invisible to the profiler on a
  CPU, so counted by wrapping them while profiling).
A decode step's counts are (count of 2·n decode steps − count of n) / n: the prefill and the
per-call work cancel. Shapes: a 30-layer tiny Llama, batch 140 (7 prompts × 20 samples) for
decoding; arith's trainer step: 4 groups × 8 completions of 24 + 32 tokens.
"""
import argparse
import contextlib
import json
import sys
from collections import Counter
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

# ops that launch no kernel on a GPU: views, metadata, allocation without a fill
NO_KERNEL = {
    "aten::view", "aten::_unsafe_view", "aten::reshape", "aten::as_strided", "aten::expand",
    "aten::unsqueeze", "aten::squeeze", "aten::slice", "aten::select", "aten::transpose",
    "aten::t", "aten::permute", "aten::empty", "aten::empty_strided", "aten::empty_like",
    "aten::detach", "aten::detach_", "aten::alias", "aten::lift_fresh", "aten::resolve_conj",
    "aten::resolve_neg", "aten::split", "aten::split_with_sizes", "aten::chunk", "aten::unbind",
    "aten::narrow", "aten::flatten", "aten::unflatten", "aten::view_as", "aten::expand_as",
    "aten::result_type", "aten::is_nonzero", "aten::item", "aten::set_", "aten::_reshape_alias",
    "aten::squeeze_", "aten::unsqueeze_", "aten::as_strided_", "aten::resize_", "aten::numel",
    "aten::size", "aten::stride", "aten::dim", "aten::is_same_size", "aten::contiguous",
    "aten::_has_compatible_shallow_copy_type", "aten::lift", "aten::to", "aten::type_as",
}
SYNC_OPS = {"aten::_local_scalar_dense", "aten::nonzero"}
TRANSFER = "host_transfer"                  # the marker of a wrapped tolist / numpy call


@contextlib.contextmanager
def transfers_marked():
    """Wrap `Tensor.tolist` and `Tensor.numpy` so that each call is an event of the trace."""
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}

    def marked(original):
        def call(self, *args, **kwargs):
            with torch.profiler.record_function(TRANSFER):
                return original(self, *args, **kwargs)
        return call
    for name, original in originals.items():
        setattr(torch.Tensor, name, marked(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def inside_a_kernel(event):
    """A read of a value by an op's own CPU kernel (the fused AdamW reads each parameter's step
    count), which on a GPU stays on the device: not a host sync of the code being counted."""
    parent = event.cpu_parent
    if parent is not None and parent.name == "aten::item":
        parent = parent.cpu_parent
    return parent is not None and parent.name.startswith("aten::") and parent.name != "aten::is_nonzero"


def count(fn):
    """Run fn() under the profiler. -> {"ops": n, "syncs": n, "by_op": Counter, "by_sync": Counter}"""
    with transfers_marked(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    ops, syncs = Counter(), Counter()
    for event in prof.events():
        if event.name in SYNC_OPS or event.name == TRANSFER:
            if event.name == "aten::_local_scalar_dense" and inside_a_kernel(event):
                continue
            syncs[event.name] += 1
        if (event.name.startswith("aten::") and event.name not in NO_KERNEL
                and not any(c.name.startswith("aten::") for c in event.cpu_children)):
            ops[event.name] += 1
    return {"ops": sum(ops.values()), "syncs": sum(syncs.values()), "by_op": ops, "by_sync": syncs}


def tiny_llama(layers=30, vocab=512, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None          # held to full length
    return model


class Tokenizer:
    pad_token_id, eos_token_id = 0, None


class StopAfter:
    """A stop event for `sampling.generate` (`stop_event`) that is set after `steps` decode
    steps: calls that stop at different lengths keep one cache size, so one compiled shape."""

    def __init__(self, steps):
        self.steps, self.calls = steps, 0

    def is_set(self):
        self.calls += 1
        return self.calls > self.steps


def decode_step(sampling, model, prompts=7, samples=20, prompt_len=24, steps=8, **kwargs):
    """Ops and syncs of one decode step of `sampling.generate` at batch prompts × samples: the
    counts of a call stopped after 2·steps tokens less those of one stopped after `steps`, both
    with a cache sized for 2·steps + 1 (a compiled step is then compiled once, in the warm-up)."""
    ids = torch.randint(3, model.config.vocab_size, (prompts, prompt_len)).tolist()

    def call(n):
        return lambda: sampling.generate(model, Tokenizer(), ids, num_samples=samples,
                                         max_new_tokens=2 * steps + 1, with_logprobs=True,
                                         stop_event=StopAfter(n), **kwargs)
    call(2)()                                                        # warm-up (and compiling)
    short, long = count(call(steps)), count(call(2 * steps))
    return {"ops": (long["ops"] - short["ops"]) / steps,
            "syncs": (long["syncs"] - short["syncs"]) / steps,
            "by_sync": {k: v / steps for k, v in (long["by_sync"] - short["by_sync"]).items()}}


def compiled_on_the_cpu(model):
    """Ask transformers to compile the decoding step on the CPU too (inductor, no CUDA graphs),
    as it does by itself on a GPU: the host's ops outside the compiled graph are what is left."""
    from transformers import CompileConfig
    compile_config = CompileConfig(mode="default", dynamic=False)
    compile_config._compile_all_devices = True
    model.generation_config.compile_config = compile_config
    return model


def arith_batch(batch_module, groups=4, k=8, prompt_len=24, response_len=32, vocab=512):
    """A GroupBatch of arith's shape with random tokens; some completions end early."""
    torch.manual_seed(1)
    lengths = torch.randint(response_len // 2, response_len + 1, (groups, k))
    lengths[:, 0] = response_len
    return batch_module.GroupBatch(
        prompt_ids=torch.randint(3, vocab, (groups, prompt_len)),
        prompt_mask=torch.ones(groups, prompt_len, dtype=torch.long),
        response_ids=torch.randint(3, vocab, (groups, k, response_len)),
        response_len=lengths, reward=torch.rand(groups, k), ref_logp=-torch.rand(groups, k) * 50,
        version=torch.zeros(groups, k, dtype=torch.long), prompt_index=torch.arange(groups),
        behaviour_logp=-torch.rand(groups, k) * 50)


def trainer_step(modules, model, micro_groups=None, dtype=torch.float32):
    """Ops and syncs of one `trainer.train_step` at arith's shape (the second of two), forward
    passes under autocast to `dtype`."""
    trainer, schedules, batch_module = modules
    optimizer, scheduler = schedules.make_optimizer(model, lr=1e-5, total_steps=10,
                                                    warmup_steps=0, decay_steps=0)
    batch = arith_batch(batch_module)

    def step():
        trainer.train_step(model, optimizer, scheduler, batch, beta=0.05, temperature=0.7,
                           micro_groups=micro_groups, max_grad_norm=1.0, dtype=dtype)
    step()
    counted = count(step)
    return {"ops": counted["ops"], "syncs": counted["syncs"], "by_sync": dict(counted["by_sync"])}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repo", default=str(REPO), help="the checkout whose code is counted")
    parser.add_argument("--out", default=None, help="write the counts to this JSON file")
    parser.add_argument("--compile", action="store_true",
                        help="also count the static cache's decoding step compiled on the CPU "
                             "(minutes of compiling)")
    args = parser.parse_args(argv)
    sys.path.insert(0, args.repo)
    torch.set_num_threads(1)
    import batch as batch_module
    import trainer
    try:                                   # the layout with folders, or the flat one before it
        from llm import sampling
        from plumbing import schedules
    except ImportError:
        import sampling
        import schedules
    model = tiny_llama()
    results = {"decode step, eager (HF's DynamicCache)": decode_step(sampling, model)}
    if hasattr(sampling, "STATIC"):
        results["decode step, static cache (eager on a CPU)"] = decode_step(
            sampling, model, cache=sampling.STATIC)
        if args.compile:
            results["decode step, static cache, compiled on the CPU"] = decode_step(
                sampling, compiled_on_the_cpu(tiny_llama()), cache=sampling.STATIC)
    modules = (trainer, schedules, batch_module)
    results["trainer step, arith shape, all groups in one pass"] = trainer_step(modules, model)
    results["trainer step, arith shape, one group a pass"] = trainer_step(modules, model, 1)
    for name, micro_groups in (("all groups in one pass", None), ("one group a pass", 1)):
        results[f"trainer step, arith shape, {name}, bfloat16 autocast"] = trainer_step(
            modules, model, micro_groups, torch.bfloat16)
    print(f"# host work per step, counted on the CPU; code: {args.repo}; torch {torch.__version__}\n")
    print("| step | kernel-launching ops | host syncs | syncs by kind |\n| --- | --- | --- | --- |")
    for name, r in results.items():
        kinds = ", ".join(f"{k.removeprefix('aten::')} {v:g}" for k, v in sorted(r["by_sync"].items()))
        print(f"| {name} | {r['ops']:.0f} | {r['syncs']:g} | {kinds} |")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
