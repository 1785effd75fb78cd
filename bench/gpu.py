"""The GPU check: what a first GPU machine should tell us, in one command of at most 8 minutes,
with no network (no model download: models of the right shape are built with random weights).

    python bench/gpu.py [--out DIR]              # on a machine with a CUDA GPU
    python bench/gpu.py --tiny --device cpu      # the same code on tiny shapes (the test suite)

It measures, and writes to DIR/gpu.md (a markdown report) and DIR/gpu.json as it goes, in
this order (each section skipped when the budget is spent):
- overlap: the same arith-shaped run (SmolLM2-135M's shape, random weights, the real tokenizer)
  with 0, 1 and 2 searchers sharing the GPU: trained samples/s, trainer wait, staleness.
- search: tokens/s of `generate` at the recipe's shape (K = 20, 188-token prompts, a cache for 512
  new tokens, no EOS) at batch 140 and 560, for SmolLM2-135M's shape and the 1.1B's, HF's eager
  loop (PREFIX) against the static cache with transformers' compiled, CUDA-graphed decoding
  (STATIC); the first call of each (compile time) reported apart.
- profile: torch.profiler tables of 16 decode steps (each cache) and of one trainer step, saved
  as DIR/profile-*.txt, with ops and host syncs per step counted as bench/overhead.py does.
- trainer: the step at arith's shape and at the paper recipe's (the 1.1B Llama of
  recipes/paper-gsm8k.toml, 7 groups × K = 20, 188 + 512 tokens), groups a pass from the memory
  model: seconds and peak GPU memory.
- tests: `pytest -m gpu` in the time left (at least --tests-s when given).
- memory: the paper recipe's step per memory option against `bench/memory.py predict`'s figure.
- sync: the legs of a weight sync (GPU → pinned staging → shared slot → a searcher's GPU).

Models are random, so completions never stop early and rewards are zero: the numbers are about
speed and memory, not learning. SmolLM2's tokenizer and config come from --model-files (a folder
with its tokenizer files and config.json; default: .gpu/smollm2, else the converted copy in
~/.cache/tba), so that the check needs no hub on the GPU machine.
"""
import argparse
import gc
import json
import os
import shutil
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
from llm import models  # noqa: E402
from devices import placement  # noqa: E402
from devices.memory import groups_per_pass  # noqa: E402
from plumbing import schedules  # noqa: E402
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
# the paper recipe's batch (recipes/paper-gsm8k.toml) and the tiny check's
RECIPE = dict(groups=7, k=20, prompt=188, response=512)
TINY_RECIPE = dict(groups=2, k=3, prompt=6, response=5)
ARITH = dict(groups=4, k=8, prompt=24, response=32)       # arith's step (tasks/arith.py)
TINY_ARITH = dict(groups=2, k=4, prompt=6, response=8)
SECTIONS = ["overlap", "search", "profile", "trainer", "tests", "memory", "sync"]
# name -> (--activation-checkpointing, --micro-completions, --dtype), as bench/memory.py
OPTIONS = {"bfloat16": (False, 0, "bfloat16"),
           "bfloat16 + checkpointing (the recipe)": (True, 0, "bfloat16"),
           "bfloat16 + checkpointing + micro-completions 4": (True, 4, "bfloat16"),
           "float32 + checkpointing + micro-completions 4": (True, 4, "float32")}
# `python bench/memory.py predict` for each option (bench/README.md, "The paper's recipe on a GPU")
PREDICTED_GB = {"bfloat16": 53.5, "bfloat16 + checkpointing (the recipe)": 24.7,
                "bfloat16 + checkpointing + micro-completions 4": 20.8,
                "float32 + checkpointing + micro-completions 4": 18.7}


class Report:
    """The markdown report and the figures, both rewritten after every section."""

    def __init__(self, out):
        self.out, self.lines, self.figures = Path(out), [], {}
        self.out.mkdir(parents=True, exist_ok=True)

    def add(self, text="", **figures):
        print(text, flush=True)
        self.lines.append(text)
        self.figures.update(figures)
        (self.out / "gpu.md").write_text("\n".join(self.lines) + "\n")
        (self.out / "gpu.json").write_text(json.dumps(self.figures, indent=1))


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


def random_batch(shape, batch, device):
    """B groups of K completions, every one full length, random token ids.  -> GroupBatch"""
    b, k, p, r = batch["groups"], batch["k"], batch["prompt"], batch["response"]
    vocab = shape["vocab_size"]
    return GroupBatch(
        prompt_ids=torch.randint(2, vocab, (b, p), device=device),
        prompt_mask=torch.ones(b, p, dtype=torch.long, device=device),
        response_ids=torch.randint(2, vocab, (b, k, r), device=device),
        response_len=torch.full((b, k), r, device=device),
        reward=torch.rand(b, k, device=device), ref_logp=-torch.rand(b, k, device=device) * 100,
        version=torch.zeros(b, k, dtype=torch.long, device=device),
        prompt_index=torch.arange(b, device=device))


def memory(report, args, device):
    """One trainer step per memory option: time and peak memory (the state included)."""
    report.add("## A trainer step of the paper recipe's shape, per memory option\n")
    report.add(f"{'tiny Llama' if args.tiny else '1.1B Llama (TinyLlama shape)'}, "
               f"{args.recipe['groups']} groups × K = {args.recipe['k']}, "
               f"{args.recipe['prompt']} + {args.recipe['response']} tokens, AdamW (fused), "
               f"one group a gradient pass (--micro-groups 1). Peak: "
               "`torch.cuda.max_memory_allocated` over the second step (weights, gradients and "
               "AdamW moments included), reserved in brackets.\n")
    report.add("| option | step (s) | peak allocated (GB) [reserved] | predicted (GB) | measured / predicted |\n"
               "| --- | --- | --- | --- | --- |")
    for name, (checkpointing, micro, dtype) in OPTIONS.items():
        model = optimizer = None
        try:
            torch.manual_seed(0)
            model = llama(args.shape, device)
            if checkpointing:
                logprobs.enable_activation_checkpointing(model)
            optimizer, scheduler = schedules.make_optimizer(model, lr=1e-6, total_steps=10,
                                                            warmup_steps=0, decay_steps=0)
            batch = random_batch(args.shape, args.recipe, device)
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
    with models.autocast(device, torch.bfloat16):
        _, _, _, response_len, _ = sampling.generate(
            model, tokenizer, prompts, num_samples=samples, max_new_tokens=max_new_tokens,
            with_logprobs=True, cache=cache, stop_event=overhead.StopAfter(steps))
    synchronize(device)
    return time.perf_counter() - start, int(response_len.sum())


def search(report, args, device):
    """Search calls: HF's eager loop against the static cache (compiled on a GPU)."""
    recipe = args.recipe
    report.add("## Search calls: eager (DynamicCache, each prompt prefilled once) against "
               "static cache + compiled decoding (bfloat16 autocast)\n")
    report.add(f"{recipe['prompt']}-token prompts, caches sized for {recipe['response']} new "
               f"tokens, timed over the first {args.search_steps} (no EOS: random weights). The "
               "first call of each shape is a warm-up (kernels; for the static path, compiling "
               "and capturing the CUDA graphs), reported apart.\n")
    report.add("| model | cache | prompts × samples | warm-up (s) | ms per decode step | tokens/s |\n"
               "| --- | --- | --- | --- | --- | --- |")
    for name, shape in args.search_shapes.items():
        model = llama(shape, device)
        for cache in (sampling.PREFIX, sampling.STATIC):
            for prompts_n in args.search_prompts:
                if time.time() > args.deadline - 60:
                    report.add(f"| {name} | {cache} | {prompts_n} × {recipe['k']} | skipped: "
                               "no time left | | |")
                    continue
                prompts = torch.randint(2, shape["vocab_size"],
                                        (prompts_n, recipe["prompt"])).tolist()
                warm, _ = timed_search(model, prompts, recipe["k"], recipe["response"], 4, cache,
                                       device)
                wall, tokens = timed_search(model, prompts, recipe["k"], recipe["response"],
                                            args.search_steps, cache, device)
                key = f"{name}/{cache}/{prompts_n * recipe['k']}"
                report.add(f"| {name} | {cache} | {prompts_n} × {recipe['k']} | {warm:.1f} | "
                           f"{1000 * wall / args.search_steps:.1f} | {tokens / wall:.0f} |",
                           **{f"decode_ms/{key}": 1000 * wall / args.search_steps,
                              f"tokens_per_s/{key}": tokens / wall, f"warmup_s/{key}": warm})
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report.add()


def profile(report, args, device):
    """Where a decode step's and a trainer step's time goes: torch.profiler tables (top ops by
    device and by host time) saved beside the report, and launches and syncs per step counted as
    bench/overhead.py counts them."""
    from torch.profiler import ProfilerActivity
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    shape, recipe = args.search_shapes[next(iter(args.search_shapes))], args.recipe
    model = llama(shape, device)
    prompts = torch.randint(2, shape["vocab_size"], (recipe["groups"], recipe["prompt"])).tolist()
    report.add("## Profiles: 16 decode steps and one trainer step\n")
    report.add("| what | ops per step | host syncs per step | table |\n| --- | --- | --- | --- |")
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"

    def save(name, prof):
        path = args.out_dir / f"profile-{name}.txt"
        path.write_text(f"# {name}: by {sort}\n" + prof.key_averages().table(sort_by=sort, row_limit=25)
                        + "\n# by cpu_time_total\n"
                        + prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
        return path.name

    for cache in (sampling.PREFIX, sampling.STATIC):
        def decode(n):
            return lambda: timed_search(model, prompts, recipe["k"], recipe["response"], n, cache,
                                        device)
        decode(4)()                                             # warm (compiled already above)
        with torch.profiler.profile(activities=activities) as prof:
            decode(16)()
        steps = min(16, recipe["response"] - 1) // 2              # a few, then twice as many
        few, many = overhead.count(decode(steps)), overhead.count(decode(2 * steps))
        ops, syncs = ((many["ops"] - few["ops"]) / steps, (many["syncs"] - few["syncs"]) / steps)
        table = save(f"decode-{cache}", prof)
        report.add(f"| decode step, {cache} | {ops:.0f} | {syncs:g} | {table} |",
                   **{f"decode_ops/{cache}": ops, f"decode_syncs/{cache}": syncs})
    optimizer, scheduler = schedules.make_optimizer(model, lr=1e-6, total_steps=10,
                                                    warmup_steps=0, decay_steps=0)
    batch = random_batch(shape, args.arith, device)

    def step():
        trainer.train_step(model, optimizer, scheduler, batch, beta=0.05, dtype=torch.bfloat16)
        synchronize(device)
    step()
    with torch.profiler.profile(activities=activities) as prof:
        step()
    counted = overhead.count(step)
    table = save("trainer-step", prof)
    report.add(f"| trainer step, arith shape | {counted['ops']} | {counted['syncs']} | {table} |\n",
               trainer_ops=counted["ops"], trainer_syncs=counted["syncs"])
    del model, optimizer


def trainer_steps(report, args, device):
    """The trainer step at arith's shape and the paper recipe's, groups a pass chosen by the
    memory model (--micro-groups 0), bfloat16 autocast."""
    report.add("## Trainer steps (bfloat16 autocast, groups a pass from the memory model)\n")
    report.add("| shape | groups × K, tokens | groups a pass | step (s, the 3rd) | peak allocated (GB) |\n"
               "| --- | --- | --- | --- | --- |")
    shapes = [(f"arith ({next(iter(args.search_shapes))})", args.search_shapes[next(iter(args.search_shapes))],
               args.arith, False),
              ("paper recipe (1.1B Llama, checkpointing)", args.shape, args.recipe, True)]
    for name, shape, batch_shape, checkpointing in shapes:
        if time.time() > args.deadline - 60:
            report.add(f"| {name} | skipped: no time left | | | |")
            continue
        model = optimizer = None
        try:
            model = llama(shape, device)
            if checkpointing:
                logprobs.enable_activation_checkpointing(model)
            optimizer, scheduler = schedules.make_optimizer(model, lr=1e-6, total_steps=10,
                                                            warmup_steps=0, decay_steps=0)
            batch = random_batch(shape, batch_shape, device).to("cpu")   # as the buffer gives it
            for _ in range(3):
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                synchronize(device)
                start = time.perf_counter()
                trainer.train_step(model, optimizer, scheduler, batch, beta=0.05,
                                   dtype=torch.bfloat16)
                synchronize(device)
                seconds = time.perf_counter() - start
            passes = groups_per_pass(model, optimizer, batch, torch.bfloat16)
            peak = torch.cuda.max_memory_allocated(device) / GB if device.type == "cuda" else float("nan")
            report.add(f"| {name} | {batch_shape['groups']} × {batch_shape['k']}, "
                       f"{batch_shape['prompt']} + {batch_shape['response']} | {passes} | "
                       f"{seconds:.3f} | {peak:.1f} |",
                       **{f"train_step_s/{name}": seconds, f"train_peak_gb/{name}": peak})
        except torch.OutOfMemoryError:
            report.add(f"| {name} | out of memory | | | |")
        finally:
            del model, optimizer
            if device.type == "cuda":
                torch.cuda.empty_cache()
    report.add()


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


def weight_sync(report, args, device):
    """The legs of a weight sync, trainer and searcher on the same GPU."""
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
    assert results.get(timeout=300)[0] == "ready"
    legs, loads = [], []
    for version in (1, 2, 3):
        legs.append(channel.publish(model, version))
        loads.append(results.get(timeout=300)[1])
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


def overlap(report, args, device, work):
    """The same arith-shaped run with 0, 1 and 2 searchers sharing the one device."""
    folder = random_smollm2(args.model_files, work / "smollm2-random", args.tiny)
    report.add(f"## Searchers sharing the {device.type.upper()}: arith's shape, "
               f"{'a tiny Llama' if args.tiny else 'SmolLM2-135M shape'}, random weights\n")
    report.add(f"`tba.py --task arith` (B = 4 prompts × K = 8, 32 new tokens: full length with "
               f"random weights), {args.steps} steps, --sync-every 2; rates over steps "
               f"{args.steps // 4 + 1}–{args.steps} (the first quarter is warm-up).\n")
    report.add("| searchers | trained samples/s | × synchronous | trainer wait (s/step) | "
               "trainer step (s) | staleness (mean) | sync probe diff (max) |\n"
               "| --- | --- | --- | --- | --- | --- | --- |")
    base = None
    for searchers in args.searchers:
        out = work / f"arith-{searchers}"
        command = [sys.executable, str(REPO / "tba.py"), "--task", "arith", "--model", str(folder),
                   "--steps", str(args.steps), "--searchers", str(searchers), "--device",
                   str(device), "--dtype", "bfloat16" if device.type == "cuda" else "float32",
                   "--eval-every", "0", "--eval-n", "4", "--save-every", "0", "--quiet",
                   "--max-reuse", "1", "--out", str(out)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.run_timeout)
        if done.returncode:
            report.add(f"| {searchers} | failed: {done.stderr.strip().splitlines()[-1:]} | | | | | |")
            continue
        rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
        rows = [r for r in rows if "loss" in r]
        first, last = rows[args.steps // 4 - 1], rows[-1]
        rate = (last["samples"] - first["samples"]) / (last["time"] - first["time"])
        later = rows[args.steps // 4:]
        base = base or rate
        wait = statistics.mean(r["trainer_wait_s"] for r in later)
        train = statistics.mean(r["train_s"] for r in later)
        stale = statistics.mean(r.get("staleness_mean", 0.0) for r in later)
        probes = [r["sync_probe_diff_max"] for r in rows if "sync_probe_diff_max" in r]
        report.add(f"| {searchers} | {rate:.1f} | {rate / base:.2f} | {wait:.3f} | {train:.3f} | "
                   f"{stale:.2f} | {max(probes) if probes else '–'} |",
                   **{f"samples_per_s/{searchers}": rate, f"trainer_wait_s/{searchers}": wait,
                      f"staleness/{searchers}": stale})
    report.add()


def cuda_tests(report, args):
    """`pytest -m gpu` in the time left."""
    left = min(args.deadline - time.time(), args.tests_s or float("inf"))
    if left < 30:
        report.add("## The CUDA tests: not run, no time left\n")
        return
    command = [sys.executable, "-m", "pytest", "-v", "-rs", "-m", "gpu", "-p", "no:cacheprovider",
               "tests/test_gpu.py", "tests/test_trainer.py", "tests/test_run.py"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=left)
        tail = [line for line in (done.stdout + done.stderr).strip().splitlines()
                if "PASSED" in line or "FAILED" in line or "SKIPPED" in line or "passed" in line
                or "Error" in line][-40:]
    except subprocess.TimeoutExpired as e:
        partial = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        tail = [f"timed out after {left:.0f} s"] + partial.strip().splitlines()[-10:]
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
    parser.add_argument("--budget", type=float, default=480, help="seconds for the whole check")
    parser.add_argument("--tests-s", type=float, default=0,
                        help="seconds for the tests at most (default: what the budget leaves)")
    parser.add_argument("--run-steps", type=int, default=20, help="steps of each overlap run")
    args = parser.parse_args(argv)
    args.deadline = time.time() + args.budget
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
    args.arith = TINY_ARITH if args.tiny else ARITH
    args.search_prompts = [2, 4] if args.tiny else [7, 28]      # batch 140 and 560 at K = 20
    args.search_steps = min(args.search_steps, args.recipe["response"])
    args.out_dir = Path(args.out)
    args.search_shapes = ({"tiny Llama": TINY} if args.tiny
                          else {"SmolLM2-135M shape": smol, "1.1B Llama shape": LLAMA_1B})
    args.sync_shape = (TINY, "tiny Llama") if args.tiny else (LLAMA_1B, "1.1B Llama shape")
    args.steps, args.searchers = (4, [0, 1]) if args.tiny else (args.run_steps, [0, 1, 2])
    args.run_timeout = 300
    report = Report(args.out)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    import transformers
    report.add(f"# GPU check on {name}\n\ntorch {torch.__version__}, transformers "
               f"{transformers.__version__}, {placement.usable_cores()} CPU cores\n",
               device=name, torch=torch.__version__, transformers=transformers.__version__)
    sections = {"memory": lambda: memory(report, args, device),
                "search": lambda: search(report, args, device),
                "profile": lambda: profile(report, args, device),
                "trainer": lambda: trainer_steps(report, args, device),
                "sync": lambda: weight_sync(report, args, device),
                "overlap": lambda: overlap(report, args, device, work),
                "tests": lambda: cuda_tests(report, args)}
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        for section in args.only:
            start = time.time()
            try:
                sections[section]()
            except Exception as e:                # report it and go on to the next section
                report.add(f"**{section} failed**: {type(e).__name__}\n\n```\n"
                           f"{traceback.format_exc()[-1500:]}\n```\n")
            gc.collect()
            if device.type == "cuda":          # what this section cached, for the next one
                torch.cuda.empty_cache()
            print(f"[{section}: {time.time() - start:.0f} s]", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
