"""The GPU check: what a first GPU machine should tell us, in one command of at most 8 minutes,
with no network (no model download: models of the right shape are built with random weights).

    python bench/gpu.py [--out DIR]              # on a machine with a CUDA GPU
    python bench/gpu.py --tiny --device cpu      # the same code on tiny shapes (the test suite)

It writes DIR/gpu.md (a markdown report) and DIR/gpu.json as it goes: first what attention
SDPA may use (its four backend switches, cuDNN's version), then, in this order:
- overlap: `tba.py --task arith` (SmolLM2-135M's shape, random weights, the real tokenizer, so
  arith's own left-padded prompts) with 0, 1 and 2 searchers sharing the GPU: whether each run
  stayed finite for all its steps, trained samples/s, trainer wait, staleness.
- search: tokens/s of `generate` at the recipe's shape (K = 20, GSM8K-long prompts up to 188
  tokens, a cache for 512 new tokens, no EOS) at batch 140 and 560, for SmolLM2-135M's shape and
  the 1.1B's, HF's eager loop (PREFIX) against the static cache with transformers' compiled,
  CUDA-graphed decoding (STATIC); batch 140 of both models first, the first call of each (compile
  time) reported apart.
- profile: torch.profiler tables of 8 decode steps (each cache) and of one trainer step, saved
  as DIR/profile-*.txt, with ops and host syncs per step counted as bench/overhead.py does.
- trainer: three steps at arith's shape and three at the paper recipe's (the 1.1B Llama of
  recipes/paper-gsm8k.toml, 7 groups × K = 20, + 512 tokens), groups a pass from the memory
  model: whether each step was finite, seconds, peak GPU memory, and the SDPA kernels that ran
  in one arith step (torch.profiler).
- tests: `pytest -m gpu`.
- memory: the paper recipe's step per memory option against `bench/memory.py predict`'s figure.
- sync: the legs of a weight sync (GPU → pinned staging → shared slot → a searcher's GPU).

Trainer batches are what the replay buffer hands over: B prompts of different lengths, left
padded to the widest, with their [B, P] mask, drawn from the prompt lengths of the task the
shape imitates (arith's 59–64 tokens, GSM8K's; ARITH and RECIPE below). An arith step whose
widest prompt is 64 tokens is in the trainer section on purpose: a key length of 64 mod 128 with
a masked attention row is where cuDNN's SDPA backward returned NaN (pytorch/pytorch#196678),
and every overlap run on an H200 stopped on a NaN gradient.

Time: each section gets its share of --budget (SHARES; of the time left when it starts, among
the sections still to run, so what one leaves goes to the next), checks it before each of its
measurements (which it assumes takes as long as its longest so far) and reports what it skipped.

Models are random, so completions never stop early and rewards are zero: the numbers are about
speed, memory and finiteness, not learning. SmolLM2's tokenizer and config come from
--model-files (a folder with its tokenizer files and config.json; default: .gpu/smollm2, else
the converted copy in ~/.cache/tba), so that the check needs no hub on the GPU machine.
"""
import argparse
import gc
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(1, str(REPO / "bench"))      # overhead.py, after the repo (bench/buffer.py)
from llm import logprobs  # noqa: E402
from llm import sampling  # noqa: E402
from llm import models, precision  # noqa: E402
from devices import placement  # noqa: E402
from devices.memory import groups_per_pass  # noqa: E402
from plumbing import schedules  # noqa: E402
from plumbing.errors import NonFiniteError  # noqa: E402
import trainer  # noqa: E402
import overhead  # noqa: E402
from batch import GroupBatch  # noqa: E402
from devices.weights import WeightChannel  # noqa: E402

GB = 1024 ** 3

LLAMA_1B = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=32,
                num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048,
                num_hidden_layers=22)
TINY = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512, max_position_embeddings=256, num_hidden_layers=2)
# Prompt lengths in tokens, under SmolLM2-135M-Instruct's tokenizer and the chat template the
# tasks use (`AnswerTask.prompts`: `tasks.make_task(config.resolve(config.parse_args(["--task",
# name])[0])).prompts(split, tokenizer)`, the tokenizer of ~/.cache/tba/SmolLM2-135M-Instruct):
# - arith (its defaults: 1 digit, 1 step, + and -): 59–64, mean 61.1; of the 5,000 train prompts
#   59: 561, 60: 1,428, 61: 1,084, 62: 891, 63: 813, 64: 223 (the 200 test prompts alike). The
#   widest of a step's 4 prompts is 64 in 1 step of 6 (1 − (1 − 223/5000)^4 = 0.17).
# - GSM8K (../shared/data/gsm8k/train.jsonl, 7,473 prompts): 65–276, mean 113, median 109,
#   p10 90, p90 143, p99 183; its 7 evenly spaced quantiles (1/14, 3/14, ...) 88, 96, 102, 109,
#   117, 127, 149. The paper recipe prompts its model in plain text ("[MATH TASK] Problem: ...",
#   26–237 tokens, median 70, under the same tokenizer; the recipe's own Llama tokenizer is not
#   on this machine): the chat lengths are the longer, so the safer for memory.
# Each shape's `prompts` is one tuple of B lengths a step (steps cycle through them): batches
# are left padded to each step's widest, as the replay buffer hands them over.
ARITH = dict(groups=4, k=8, response=32,          # arith's step (tasks/arith.py), 3 steps:
             prompts=[(60, 63, 61, 59),           # typical lengths; the 2nd and 3rd steps'
                      (62, 64, 60, 61),           # widest is 64 (cuDNN's NaN: key length 64
                      (64, 59, 62, 60)])          # mod 128 with a masked row)
TINY_ARITH = dict(groups=2, k=4, response=8, prompts=[(60, 63), (62, 64), (64, 59)])
# the paper recipe's batch (recipes/paper-gsm8k.toml): GSM8K's 7 quantiles, the widest raised
# to 188 (the width of the earlier figures; the widest of 7 GSM8K prompts is that long in 1 step
# of 20)
RECIPE = dict(groups=7, k=20, response=512, prompts=[(109, 88, 188, 96, 127, 102, 117)])
TINY_RECIPE = dict(groups=2, k=3, response=5, prompts=[(6, 4)])
SECTIONS = ["overlap", "search", "profile", "trainer", "tests", "memory", "sync"]
# each section's share of the budget (of the time left when it starts, among those to run)
SHARES = dict(overlap=0.30, search=0.25, profile=0.07, trainer=0.10, tests=0.13, memory=0.09,
              sync=0.06)
# name -> (--activation-checkpointing, --micro-completions, --dtype), as bench/memory.py
OPTIONS = {"bfloat16": (False, 0, "bfloat16"),
           "bfloat16 + checkpointing (the recipe)": (True, 0, "bfloat16"),
           "bfloat16 + checkpointing + micro-completions 4": (True, 4, "bfloat16"),
           "float32 + checkpointing + micro-completions 4": (True, 4, "float32")}
# `python bench/memory.py predict` for each option (bench/README.md, "The paper's recipe on a GPU")
PREDICTED_GB = {"bfloat16": 53.5, "bfloat16 + checkpointing (the recipe)": 24.7,
                "bfloat16 + checkpointing + micro-completions 4": 20.8,
                "float32 + checkpointing + micro-completions 4": 18.7}
SDP_BACKENDS = ("cudnn", "flash", "mem_efficient", "math")
# parts of the names of SDPA's ops and kernels in a torch.profiler trace
ATTENTION_NAMES = ("scaled_dot_product", "sdpa", "attention", "fmha", "flash")


class Report:
    """The markdown report and the figures, both rewritten after every line."""

    def __init__(self, out):
        self.out, self.lines, self.figures = Path(out), [], {}
        self.out.mkdir(parents=True, exist_ok=True)

    def add(self, text="", **figures):
        print(text, flush=True)
        self.lines.append(text)
        self.figures.update(figures)
        (self.out / "gpu.md").write_text("\n".join(self.lines) + "\n")
        (self.out / "gpu.json").write_text(json.dumps(self.figures, indent=1))


class Clock:
    """A section's share of the budget. A section asks `next(what)` before each of its
    measurements: a measurement is assumed to take as long as the longest one so far, and one
    that would not fit is skipped and remembered, so that the section stops in time and says
    what it left out."""

    def __init__(self, seconds):
        self.seconds, self.deadline = seconds, time.time() + seconds
        self.longest, self.started, self.skipped = 0.0, None, []

    def left(self):
        return self.deadline - time.time()

    def next(self, what, at_least=0.0):
        """Whether `what` fits in what is left, taking as long as the longest measurement so far
        or `at_least` seconds (it then counts as started).                        -> bool"""
        now = time.time()
        if self.started is not None:
            self.longest = max(self.longest, now - self.started)
        self.started = None
        if self.deadline - now <= max(self.longest, at_least):
            self.skipped.append(what)
            return False
        self.started = now
        return True


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def llama(shape, device, dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(**shape, bos_token_id=1, eos_token_id=None, pad_token_id=0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    model.generation_config.eos_token_id = None       # held to full length
    return model


def left_padded(lengths, vocab, device):
    """Random prompts of these lengths, left padded (pad id 0) to the widest.
                                                                -> ids [B, P], mask [B, P]"""
    width = max(lengths)
    mask = torch.tensor([[0] * (width - n) + [1] * n for n in lengths], device=device)  # [B, P]
    return torch.randint(2, vocab, mask.shape, device=device) * mask, mask


def random_batch(shape, batch, device, step=0):
    """B groups of K completions, every one full length, random token ids, the prompts of the
    shape's `step`-th tuple of lengths left padded.                            -> GroupBatch"""
    b, k, r = batch["groups"], batch["k"], batch["response"]
    lengths = batch["prompts"][step % len(batch["prompts"])]
    assert len(lengths) == b, (lengths, b)
    prompt_ids, prompt_mask = left_padded(lengths, shape["vocab_size"], device)     # [B, P] each
    return GroupBatch(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask,
        response_ids=torch.randint(2, shape["vocab_size"], (b, k, r), device=device),
        response_len=torch.full((b, k), r, device=device),
        reward=torch.rand(b, k, device=device), ref_logp=-torch.rand(b, k, device=device) * 100,
        version=torch.zeros(b, k, dtype=torch.long, device=device),
        prompt_index=torch.arange(b, device=device))


def search_prompts(batch, n, vocab):
    """n random prompts (lists of ids) with the lengths of the shape's first step, cycled."""
    lengths = batch["prompts"][0]
    return [torch.randint(2, vocab, (lengths[i % len(lengths)],)).tolist() for i in range(n)]


def spans(steps):
    """Each step's prompt lengths, as a table cell: "59–63, 60–64" (shortest–widest)."""
    return ", ".join(f"{min(p)}–{max(p)}" for p in steps)


def attention_setup(device):
    """What SDPA may run on in this process, as `placement.set_up_process` left it (every tba
    process sets itself up so): the backend switches, and cuDNN's version on a GPU.  -> dict"""
    return dict(sdp_enabled={name: getattr(torch.backends.cuda, f"{name}_sdp_enabled")()
                             for name in SDP_BACKENDS},
                cudnn_version=torch.backends.cudnn.version() if device.type == "cuda" else None)


def attention_kernels(prof):
    """The SDPA ops and kernels in a torch.profiler trace, and the backends they belong to:
    cudnn, flash (on a CPU: its flash kernel), efficient (mem_efficient) or math.
                                                            -> (sorted backends, sorted names)"""
    names = sorted({event.key for event in prof.key_averages()
                    if any(part in event.key.lower() for part in ATTENTION_NAMES)})
    backends = set()
    for name in map(str.lower, names):
        for backend, parts in (("cudnn", ("cudnn",)), ("flash", ("flash",)),
                               ("efficient", ("efficient", "fmha", "cutlass")),
                               ("math", ("math",))):
            if any(part in name for part in parts):
                backends.add(backend)
                break
    return sorted(backends), names


def memory(report, args, device, clock):
    """One trainer step per memory option: time and peak memory (the state included)."""
    recipe = args.recipe
    report.add("## A trainer step of the paper recipe's shape, per memory option\n")
    report.add(f"{args.shape_name}, {recipe['groups']} groups × K = {recipe['k']}, prompts of "
               f"{spans(recipe['prompts'])} tokens (left padded) + {recipe['response']}, AdamW "
               "(fused), one group a gradient pass (--micro-groups 1). Peak: "
               "`torch.cuda.max_memory_allocated` over the second step (weights, gradients and "
               "AdamW moments included), reserved in brackets.\n")
    report.add("| option | step (s) | peak allocated (GB) [reserved] | predicted (GB) | measured / predicted |\n"
               "| --- | --- | --- | --- | --- |")
    for name, (checkpointing, micro, dtype) in OPTIONS.items():
        if not clock.next(name):
            continue
        model = optimizer = None
        try:
            torch.manual_seed(0)
            model = llama(args.shape, device)
            if checkpointing:
                logprobs.enable_activation_checkpointing(model)
            optimizer, scheduler = schedules.make_optimizer(model, lr=1e-6, total_steps=10,
                                                            warmup_steps=0, decay_steps=0)
            batch = random_batch(args.shape, recipe, device)
            times = []
            for step in range(2):
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                synchronize(device)
                start = time.perf_counter()
                trainer.train_step(model, optimizer, scheduler, batch, beta=0.01, micro_groups=1,
                                   micro_completions=micro, dtype=getattr(torch, dtype))
                synchronize(device)
                times.append(time.perf_counter() - start)
            peak = reserved = float("nan")
            if device.type == "cuda":
                peak = torch.cuda.max_memory_allocated(device) / GB
                reserved = torch.cuda.max_memory_reserved(device) / GB
            report.add(f"| {name} | {times[-1]:.2f} | {peak:.1f} [{reserved:.1f}] | "
                       f"{PREDICTED_GB[name]} | {peak / PREDICTED_GB[name]:.2f} |",
                       **{f"step_s/{name}": times[-1], f"peak_gb/{name}": peak})
        except torch.OutOfMemoryError:
            report.add(f"| {name} | out of memory | | {PREDICTED_GB[name]} | |")
        finally:
            del model, optimizer
            if device.type == "cuda":
                torch.cuda.empty_cache()
    report.add()


def timed_search(model, prompts, samples, max_new_tokens, steps, cache, device):
    """One `generate` call under bfloat16 autocast, stopped after `steps` tokens.  -> (s, tokens)"""
    tokenizer = type("Tokenizer", (), {"pad_token_id": 0, "eos_token_id": None})()
    synchronize(device)
    start = time.perf_counter()
    with precision.autocast(device, torch.bfloat16):
        _, _, _, response_len, _ = sampling.generate(
            model, tokenizer, prompts, num_samples=samples, max_new_tokens=max_new_tokens,
            with_logprobs=True, cache=cache, stop_event=overhead.StopAfter(steps))
    synchronize(device)
    return time.perf_counter() - start, int(response_len.sum())


def search(report, args, device, clock):
    """Search calls: HF's eager loop against the static cache (compiled on a GPU), the recipe's
    batch (140) of both models first. The first model stays built for the profile section, whose
    static decoding it has compiled already."""
    recipe = args.recipe
    report.add("## Search calls: eager (DynamicCache, each prompt prefilled once) against "
               "static cache + compiled decoding (bfloat16 autocast)\n")
    report.add(f"Prompts of {spans(recipe['prompts'])} tokens (GSM8K's, left padded), caches "
               f"sized for {recipe['response']} new tokens, timed over the first "
               f"{args.search_steps} (no EOS: random weights). The first call of each shape is a "
               "warm-up (kernels; for the static path, compiling and capturing the CUDA graphs), "
               "reported apart.\n")
    report.add("| model | cache | prompts × samples | warm-up (s) | ms per decode step | tokens/s |\n"
               "| --- | --- | --- | --- | --- | --- |")
    built = {}
    for prompts_n in args.search_prompts:
        for name, shape in args.search_shapes.items():
            for cache in (sampling.STATIC, sampling.PREFIX):
                key = f"{name}/{cache}/{prompts_n * recipe['k']}"
                if not clock.next(f"search {key}"):
                    continue
                if name not in built:
                    built[name] = llama(shape, device)
                model = built[name]
                prompts = search_prompts(recipe, prompts_n, shape["vocab_size"])
                warm, _ = timed_search(model, prompts, recipe["k"], recipe["response"], 4, cache,
                                       device)
                wall, tokens = timed_search(model, prompts, recipe["k"], recipe["response"],
                                            args.search_steps, cache, device)
                report.add(f"| {name} | {cache} | {prompts_n} × {recipe['k']} | {warm:.1f} | "
                           f"{1000 * wall / args.search_steps:.1f} | {tokens / wall:.0f} |",
                           **{f"decode_ms/{key}": 1000 * wall / args.search_steps,
                              f"tokens_per_s/{key}": tokens / wall, f"warmup_s/{key}": warm})
    args.profile_model = built.pop(next(iter(args.search_shapes)), None)
    del built
    report.add()


def profile(report, args, device, clock):
    """Where a decode step's and a trainer step's time goes: torch.profiler tables (top ops by
    device and by host time) saved beside the report, and launches and syncs per step counted as
    bench/overhead.py counts them. Small: 8 decode steps a cache, one arith trainer step."""
    from torch.profiler import ProfilerActivity
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    shape, recipe = args.search_shapes[next(iter(args.search_shapes))], args.recipe
    # search hands its first model over once it has run (and, on a GPU, compiled) its static
    # decoding at the recipe's batch, the first item of each model there
    compiled = args.profile_model is not None and device.type == "cuda"
    model, args.profile_model = args.profile_model or llama(shape, device), None
    prompts = search_prompts(recipe, recipe["groups"], shape["vocab_size"])
    report.add("## Profiles: 8 decode steps and one trainer step\n")
    report.add("| what | ops per step | host syncs per step | table |\n| --- | --- | --- | --- |")
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"

    def save(name, prof):
        path = args.out_dir / f"profile-{name}.txt"
        path.write_text(f"# {name}: by {sort}\n" + prof.key_averages().table(sort_by=sort, row_limit=25)
                        + "\n# by cpu_time_total\n"
                        + prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
        return path.name

    for cache in (sampling.PREFIX, sampling.STATIC):
        compiling = cache == sampling.STATIC and device.type == "cuda" and not compiled
        if not clock.next(f"decode profile, {cache}", at_least=60 if compiling else 0):
            continue

        def decode(n):
            return lambda: timed_search(model, prompts, recipe["k"], recipe["response"], n, cache,
                                        device)
        decode(2)()                               # warm (compiled already when search ran)
        with torch.profiler.profile(activities=activities) as prof:
            decode(8)()
        steps = min(8, recipe["response"] - 1) // 2              # a few, then twice as many
        few, many = overhead.count(decode(steps)), overhead.count(decode(2 * steps))
        ops, syncs = ((many["ops"] - few["ops"]) / steps, (many["syncs"] - few["syncs"]) / steps)
        table = save(f"decode-{cache}", prof)
        report.add(f"| decode step, {cache} | {ops:.0f} | {syncs:g} | {table} |",
                   **{f"decode_ops/{cache}": ops, f"decode_syncs/{cache}": syncs})
    if clock.next("trainer step profile"):
        optimizer, scheduler = schedules.make_optimizer(model, lr=1e-6, total_steps=10,
                                                        warmup_steps=0, decay_steps=0)
        batch = random_batch(shape, args.arith, device, step=1)

        def step():
            trainer.train_step(model, optimizer, scheduler, batch, beta=0.05, dtype=torch.bfloat16)
            synchronize(device)
        step()                                    # warm: AdamW's state, kernels
        with torch.profiler.profile(activities=activities) as prof:
            step()
        counted = overhead.count(step)
        table = save("trainer-step", prof)
        report.add(f"| trainer step, arith shape | {counted['ops']} | {counted['syncs']} | "
                   f"{table} |",
                   trainer_ops=counted["ops"], trainer_syncs=counted["syncs"])
    report.add()
    del model


def trainer_steps(report, args, device, clock):
    """Three trainer steps at arith's shape and three at the paper recipe's, each step's prompts
    of different lengths (left padded), groups a pass chosen by the memory model (--micro-groups
    0), bfloat16 autocast: whether each step's loss and gradient were finite, and the time of
    the last. Then one arith step at the widest prompts under torch.profiler: which SDPA
    kernels ran."""
    first = next(iter(args.search_shapes))
    report.add("## Trainer steps (bfloat16 autocast, groups a pass from the memory model)\n")
    report.add("Each step's prompts have different lengths, left padded to its widest (the "
               "shortest–widest of each step below), as the replay buffer hands them over.\n")
    report.add("| shape | groups × K | prompt tokens, each step | response tokens | groups a pass "
               "| finite steps | step (s, the last) | peak allocated (GB) |\n"
               "| --- | --- | --- | --- | --- | --- | --- | --- |")
    shapes = [("arith", f"arith ({first})", args.search_shapes[first], args.arith, False),
              ("recipe", f"paper recipe ({args.shape_name}, checkpointing)", args.shape,
               args.recipe, True)]
    kernels, notes = None, []
    for key, name, shape, batch_shape, checkpointing in shapes:
        if not clock.next(f"trainer steps, {name}"):
            continue
        model = optimizer = None
        try:
            model = llama(shape, device)
            if checkpointing:
                logprobs.enable_activation_checkpointing(model)
            optimizer, scheduler = schedules.make_optimizer(model, lr=1e-6, total_steps=10,
                                                            warmup_steps=0, decay_steps=0)
            batches = [random_batch(shape, batch_shape, device, step).to("cpu")  # as the
                       for step in range(3)]                                  # buffer gives it
            finite = []
            for batch in batches:
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                synchronize(device)
                start = time.perf_counter()
                try:
                    trainer.train_step(model, optimizer, scheduler, batch, beta=0.05,
                                       dtype=torch.bfloat16)
                    finite.append(True)
                except NonFiniteError as e:              # nothing applied: the next step goes on
                    finite.append(False)
                    notes.append(f"{name}, step {len(finite)} (widest prompt "
                                 f"{batch.prompt_ids.shape[1]}): {e}")
                synchronize(device)
                seconds = time.perf_counter() - start
            passes = groups_per_pass(model, optimizer, batches[-1], torch.bfloat16)
            peak = torch.cuda.max_memory_allocated(device) / GB if device.type == "cuda" else float("nan")
            lengths = [b.prompt_mask.sum(1).tolist() for b in batches]       # [3][B]
            report.add(f"| {name} | {batch_shape['groups']} × {batch_shape['k']} | "
                       f"{spans(lengths)} | {batch_shape['response']} | {passes} | "
                       f"{sum(finite)} of {len(finite)} | {seconds:.3f} | {peak:.1f} |",
                       **{f"train_step_s/{key}": seconds, f"train_peak_gb/{key}": peak,
                          f"train_finite/{key}": finite, f"train_prompt_lengths/{key}": lengths})
            if key == "arith":
                kernels = attention_in_a_step(model, optimizer, scheduler, batch_shape, shape,
                                              device)
        except torch.OutOfMemoryError:
            report.add(f"| {name} | out of memory | | | | | | |")
        finally:
            del model, optimizer
            if device.type == "cuda":
                torch.cuda.empty_cache()
    report.add("".join(f"\nNot finite: {note}" for note in notes) + "\n" if notes else "")
    if kernels:
        backends, names, widest = kernels
        report.add(f"Attention kernels in one arith step (widest prompt {widest}, "
                   f"torch.profiler): **{', '.join(backends) or 'no SDPA'}**"
                   + (" (on the CPU: SDPA's CPU kernels; the switches above are CUDA's)"
                      if device.type == "cpu" else "")
                   + ". " + ", ".join(f"`{n}`" for n in names[:12]) + "\n",
                   sdpa_backends=backends, sdpa_kernels=names)


def attention_in_a_step(model, optimizer, scheduler, batch_shape, shape, device):
    """One trainer step on the step of widest prompts, under torch.profiler.
                                                    -> (backends, op and kernel names, widest)"""
    from torch.profiler import ProfilerActivity
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    widest = max(range(len(batch_shape["prompts"])), key=lambda s: max(batch_shape["prompts"][s]))
    batch = random_batch(shape, batch_shape, device, widest).to("cpu")
    with torch.profiler.profile(activities=activities) as prof:
        try:
            trainer.train_step(model, optimizer, scheduler, batch, beta=0.05, dtype=torch.bfloat16)
        except NonFiniteError:                      # reported by the steps above; kernels ran
            pass
        synchronize(device)
    return *attention_kernels(prof), batch.prompt_ids.shape[1]


def load_in_searcher(shape, device, channel, results):
    """The searcher side of the sync check: load every published version, time each load."""
    placement.set_up_process(device, 1)
    model = llama(shape, placement.tensor_device(device))
    version = channel.receive(model, 0, -1, block=True)
    results.put(("ready", 0.0))
    while version < 3:
        start = time.perf_counter()
        version = channel.receive(model, 0, version, block=True)
        results.put((version, time.perf_counter() - start))


def weight_sync(report, args, device, clock):
    """The legs of a weight sync, trainer and searcher on the same GPU."""
    if not clock.next("the weight sync"):
        return
    shape, name = args.sync_shape
    model = llama(shape, device)
    size = WeightChannel.bytes_needed(model) / 2
    free = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else float("inf")
    if 2 * size > free / 1.5:
        report.add(f"## Weight sync: skipped, /dev/shm has {free / GB:.1f} GB free\n")
        return
    ctx = mp.get_context("spawn")
    channel = WeightChannel(model, 1, ctx, device=device)
    channel.publish(model, 0)
    results = ctx.Queue()
    reader = ctx.Process(target=load_in_searcher, args=(shape, str(device), channel, results))
    reader.start()
    wait = max(clock.left(), 60)
    assert results.get(timeout=wait)[0] == "ready"
    legs, loads = [], []
    for version in (1, 2, 3):
        legs.append(channel.publish(model, version))
        loads.append(results.get(timeout=wait)[1])
    reader.join()
    channel.close()
    to_host = statistics.median(leg["sync_to_host_s"] for leg in legs)
    to_slot = statistics.median(leg["sync_to_slot_s"] for leg in legs)
    load = statistics.median(loads)
    report.add(f"## Weight sync ({name}, {size / GB:.2f} GB of float32 weights)\n")
    report.add("| leg | seconds (median of 3) | GB/s |\n| --- | --- | --- |\n"
               f"| trainer: GPU → pinned staging | {to_host:.3f} | {size / GB / max(to_host, 1e-9):.1f} |\n"
               f"| trainer: staging → shared slot | {to_slot:.3f} | {size / GB / max(to_slot, 1e-9):.1f} |\n"
               f"| searcher: slot → its staging → its GPU | {load:.3f} | {size / GB / max(load, 1e-9):.1f} |\n",
               sync_to_host_s=to_host, sync_to_slot_s=to_slot, searcher_load_s=load)
    del model


def random_smollm2(model_files, folder, tiny):
    """SmolLM2-135M's shape (or a tiny one) with random weights and the real tokenizer."""
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM
    config = AutoConfig.from_pretrained(model_files)
    if tiny:
        config.update(dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8))
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(model_files).save_pretrained(folder)
    return folder


def run_for(command, seconds, cwd=None):
    """Run a command for at most `seconds`, then ask it to stop (SIGTERM: tba.py ends the step,
    stops its searchers and keeps its metrics; a kill would leave the searchers running), and
    kill it if it has not stopped a minute later.   -> (returncode, stdout, stderr, timed out)"""
    with subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as process:
        try:
            out, err = process.communicate(timeout=max(seconds, 1))
            return process.returncode, out, err, False
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGTERM)
            try:
                out, err = process.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                out, err = process.communicate()
            return process.returncode, out, err, True


def overlap(report, args, device, clock):
    """The same arith run with 0, 1 and 2 searchers sharing the one device: whether each stayed
    finite for all its steps, and what the asynchrony gains."""
    folder = random_smollm2(args.model_files, args.work / "smollm2-random", args.tiny)
    report.add(f"## Searchers sharing the {device.type.upper()}: arith, "
               f"{'a tiny Llama' if args.tiny else 'SmolLM2-135M shape'}, random weights\n")
    report.add(f"`tba.py --task arith` (B = 4 prompts × K = 8, arith's own prompts: 59–64 "
               f"tokens, left padded; 32 new tokens, full length with random weights), "
               f"{args.steps} steps, --sync-every 2; rates over steps "
               f"{args.steps // 4 + 1}–{args.steps} (the first quarter is warm-up). Finite: every "
               "step's loss and gradient norm finite (the trainer stops a run at the first that "
               "is not).\n")
    report.add("| searchers | finite | trained samples/s | × synchronous | trainer wait "
               "(s/step) | trainer step (s) | staleness (mean) | sync probe diff (max) |\n"
               "| --- | --- | --- | --- | --- | --- | --- | --- |")
    base = None
    for searchers in args.searchers:
        if not clock.next(f"overlap run with {searchers} searchers"):
            continue
        out = args.work / f"arith-{searchers}"
        command = [sys.executable, str(REPO / "tba.py"), "--task", "arith", "--model", str(folder),
                   "--steps", str(args.steps), "--searchers", str(searchers), "--device",
                   str(device), "--dtype", "bfloat16" if device.type == "cuda" else "float32",
                   "--eval-every", "0", "--eval-n", "4", "--save-every", "0", "--quiet",
                   "--max-reuse", "1", "--out", str(out)]
        code, _, err, timed_out = run_for(command, clock.left())
        metrics = out / "metrics.jsonl"
        rows = [json.loads(line) for line in open(metrics)] if metrics.is_file() else []
        rows = [r for r in rows if "loss" in r]
        finite = all(math.isfinite(r["loss"]) and math.isfinite(r.get("grad_norm", 0.0))
                     for r in rows)
        done = not code and len(rows) == args.steps
        figures = {f"finite/{searchers}": finite and done, f"steps_done/{searchers}": len(rows)}
        if timed_out:
            report.add(f"| {searchers} | stopped when the section's share was spent: "
                       f"{len(rows)} of {args.steps} steps, {'all' if finite else 'not all'} "
                       "finite | | | | | | |", **figures)
            continue
        if not (finite and done):
            report.add(f"| {searchers} | **no**: {len(rows)} of {args.steps} steps, exit {code}: "
                       f"{(err.strip().splitlines() or [''])[-1]} | | | | | | |", **figures)
            continue
        first, last = rows[args.steps // 4 - 1], rows[-1]
        rate = (last["samples"] - first["samples"]) / (last["time"] - first["time"])
        later = rows[args.steps // 4:]
        base = base or rate
        wait = statistics.mean(r["trainer_wait_s"] for r in later)
        train = statistics.mean(r["train_s"] for r in later)
        stale = statistics.mean(r.get("staleness_mean", 0.0) for r in later)
        probes = [r["sync_probe_diff_max"] for r in rows if "sync_probe_diff_max" in r]
        report.add(f"| {searchers} | yes, {len(rows)} of {args.steps} steps | {rate:.1f} | "
                   f"{rate / base:.2f} | {wait:.3f} | {train:.3f} | {stale:.2f} | "
                   f"{max(probes) if probes else '–'} |",
                   **figures, **{f"samples_per_s/{searchers}": rate,
                                 f"trainer_wait_s/{searchers}": wait,
                                 f"staleness/{searchers}": stale})
    report.add()


def cuda_tests(report, args, device, clock):
    """`pytest -m gpu` in the section's time."""
    if not clock.next("the CUDA tests"):
        return
    command = [sys.executable, "-m", "pytest", "-v", "-rs", "-m", "gpu", "-p", "no:cacheprovider",
               "tests/test_gpu.py", "tests/test_trainer.py", "tests/test_run.py"]
    _, out, err, timed_out = run_for(command, clock.left(), cwd=REPO)
    tail = [line for line in (out + err).strip().splitlines()
            if "PASSED" in line or "FAILED" in line or "SKIPPED" in line or "passed" in line
            or "Error" in line][-40:]
    if timed_out:
        tail.insert(0, f"stopped after {clock.seconds:.0f} s, the section's share")
    report.add("## The CUDA tests (`pytest -m gpu`)\n\n```\n" + "\n".join(tail) + "\n```\n")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="runs/gpu-check", help="where gpu.md and gpu.json go")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (the CPU test)")
    parser.add_argument("--model-files", default="",
                        help="SmolLM2's tokenizer files and config.json (default: .gpu/smollm2, "
                             "else ~/.cache/tba/SmolLM2-135M-Instruct)")
    parser.add_argument("--only", nargs="*", default=SECTIONS, choices=SECTIONS,
                        help="the sections, in this order (overlap first: its runs are other "
                             "processes, and this one holds no GPU memory yet)")
    parser.add_argument("--search-steps", type=int, default=256,
                        help="decode steps each timed search call runs (its cache is sized for "
                             "the recipe's 512)")
    parser.add_argument("--budget", type=float, default=480,
                        help="seconds for the whole check, shared among the sections as SHARES "
                             "says")
    parser.add_argument("--tests-s", type=float, default=0,
                        help="seconds for the tests (default: their share of the budget)")
    parser.add_argument("--run-steps", type=int, default=20, help="steps of each overlap run")
    args = parser.parse_args(argv)
    deadline = time.time() + args.budget
    if not args.model_files:
        args.model_files = next((str(p) for p in (REPO / ".gpu" / "smollm2",
                                                  models.cache_dir() / "SmolLM2-135M-Instruct")
                                 if (p / "tokenizer.json").is_file()), "")
    if "overlap" in args.only and not args.model_files:
        print("error: --model-files: no SmolLM2 tokenizer found: pass a folder with its tokenizer "
              "files and config.json", file=sys.stderr)
        return 2
    device = torch.device(placement.indexed(args.device))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda: torch sees no GPU here: use --tiny --device cpu",
              file=sys.stderr)
        return 2
    placement.set_up_process(device, max(1, placement.usable_cores() // 2))
    smol = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192,
                num_hidden_layers=30, tie_word_embeddings=True)
    args.shape, args.recipe = (TINY, TINY_RECIPE) if args.tiny else (LLAMA_1B, RECIPE)
    args.shape_name = "tiny Llama" if args.tiny else "1.1B Llama shape"
    args.arith = TINY_ARITH if args.tiny else ARITH
    args.search_prompts = [2, 4] if args.tiny else [7, 28]      # batch 140 and 560 at K = 20
    args.search_steps = min(args.search_steps, args.recipe["response"])
    args.out_dir = Path(args.out)
    args.search_shapes = ({"tiny Llama": TINY} if args.tiny
                          else {"SmolLM2-135M shape": smol, "1.1B Llama shape": LLAMA_1B})
    args.sync_shape = (args.shape, args.shape_name)
    args.steps, args.searchers = (4, [0, 1]) if args.tiny else (args.run_steps, [0, 1, 2])
    args.profile_model = None                 # search's first model, handed to profile
    report = Report(args.out)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    import transformers
    report.add(f"# GPU check on {name}\n\ntorch {torch.__version__}, transformers "
               f"{transformers.__version__}, {placement.usable_cores()} CPU cores\n",
               device=name, torch=torch.__version__, transformers=transformers.__version__)
    attention = attention_setup(device)
    report.add("Attention: SDPA backends enabled (`torch.backends.cuda.*_sdp_enabled()`, as "
               "every tba process sets them up): "
               + ", ".join(f"{k} {v}" for k, v in attention["sdp_enabled"].items())
               + f"; `torch.backends.cudnn.version()` {attention['cudnn_version']}"
               + (" (a CPU run: these switches are CUDA's; what ran is in the trainer section)"
                  if device.type == "cpu" else "") + ".\n", **attention)
    sections = {"memory": memory, "search": search, "profile": profile, "trainer": trainer_steps,
                "sync": weight_sync, "overlap": overlap, "tests": cuda_tests}
    with tempfile.TemporaryDirectory() as work:
        args.work = Path(work)
        for n, section in enumerate(args.only):
            left = deadline - time.time()
            seconds = left * SHARES[section] / sum(SHARES[s] for s in args.only[n:])
            if section == "tests" and args.tests_s:
                seconds = min(args.tests_s, left)
            clock = Clock(seconds)
            try:
                sections[section](report, args, device, clock)
            except Exception as e:                # report it and go on to the next section
                report.add(f"**{section} failed**: {type(e).__name__}\n\n```\n"
                           f"{traceback.format_exc()[-1500:]}\n```\n")
            gc.collect()
            if device.type == "cuda":          # what this section cached, for the next one
                torch.cuda.empty_cache()
            spent = seconds - clock.left()
            report.add(f"*{section}: {spent:.0f} s of its {max(seconds, 0):.0f} s*"
                       + (f"; its share spent, skipped: {', '.join(clock.skipped)}"
                          if clock.skipped else "") + "\n",
                       **{f"section_s/{section}": spent, f"share_s/{section}": seconds,
                          f"skipped/{section}": clock.skipped})
    return 0


if __name__ == "__main__":
    sys.exit(main())
