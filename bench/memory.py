"""Memory: of a whole run, of one trainer step per memory option, and predicted for a big model.

    python bench/memory.py run [-- tba.py flags]   # default: 2 steps of GSM8K, one searcher
    python bench/memory.py step [--repo DIR]       # one GSM8K-sized trainer step per option
    python bench/memory.py predict                 # the paper's recipe on a 1.1B Llama
    python bench/memory.py arith [--reps N]        # arith's step: one pass or one group a pass

`run` samples the memory of the trainer and every child process every 0.2 s and reports the
peak of their sum and of each process, and the mean trainer step time. Two sums: of the
resident sets (RSS), which counts the shared-memory weight slots and buffer once in every
process that touched them, and of the proportional sets (PSS), which splits each shared page
between the processes that map it: the memory the run really takes.

`step` times one trainer step of SmolLM2-135M on a GSM8K-sized group (K = 8 completions of 200
prompt + 256 response tokens, random ids) under each memory option, each in a fresh process,
and reports the peak RSS above the trainer's state (weights, gradients, AdamW moments): the
activations and temporaries of the step. `--repo DIR` runs the plain step of another checkout
(e.g. a `git worktree` of an older commit) for a before/after row.

`arith` takes arith-sized trainer steps of SmolLM2-135M (B = 4 prompts of 60 tokens, K = 8
completions of 32, random ids) in one process and one thread, the settings in turn: all groups in
one pass without and with the freed heap handed back after the step (`placement.release_freed_heap`),
then 2 and 1 groups a pass (`--micro-groups`). Taking them in turn, N times, makes the time
ratios fair on a busy machine. It reports the mean time (the first round is warm-up and left out),
the highest RSS of the process during the step and the RSS it keeps after it.

`predict` builds models of the paper's 1.1B Llama shape (TinyLlama: 22 layers, hidden 2048, MLP
5632, 32 heads, 4 KV heads, vocab 32000) with random weights and 1 and 3 layers, measures the
step's extra memory per trained token with 1 and 3 sequences of 700 tokens, fits
extra = tokens · (a + b · layers), and predicts the trainer's peak for the recipe (one pass of
20 or 4 sequences of 700 tokens over all 22 layers) plus its state: float32 weights, gradients
and two AdamW moments (16 bytes per parameter) and, under autocast, the cached 16-bit copy of
the weights (2 bytes per parameter); no reference model, as searchers score it. Under
checkpointing a layer keeps only its input (8 kB per token), less than the allocator's noise
across runs: when the fit gives less, the prediction uses that bound and says so.
Assumptions: memory grows linearly with the number of 700-token sequences in a pass and with
the layers (attention's cost in T is inside the per-token figure), a GPU's attention kernels
keep no more than the CPU's, and the CUDA caching allocator adds ~10% over the live tensors.
`--option NAME` predicts one option only.
"""
import argparse
import ctypes
import functools
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUN_DEFAULT = ["--task", "gsm8k", "--data-dir", "../shared/data/gsm8k", "--steps", "2",
               "--eval-n", "16"]
GB = 1024 ** 3
# name -> (--activation-checkpointing, --micro-completions, --dtype)
OPTIONS = {"float32": (False, 0, "float32"),
           "float32 + checkpointing": (True, 0, "float32"),
           "float32 + checkpointing + micro-completions 2": (True, 2, "float32"),
           "bfloat16": (False, 0, "bfloat16"),
           "bfloat16 + checkpointing": (True, 0, "bfloat16")}
LLAMA_1B = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=32,
                num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048)
LLAMA_1B_LAYERS, RECIPE_TOKENS = 22, 700      # ~190 prompt + 512 new tokens
LAYERS, SEQUENCES = (1, 3), (1, 3)            # the models and passes measured for the fit
LAYER_INPUT = LLAMA_1B["hidden_size"] * 4     # bytes per token of a layer's float32 input


def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def reset_peak_rss():
    """Linux: restart the peak (VmHWM) from now, so that building the model does not count."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) * 1024


def measure_step(model, option, sequences, prompt_len, response_len, steps):
    """Warm up (AdamW allocates its moments, backward the gradients), release freed memory to
    the OS, then time `steps` trainer steps. -> (seconds per step, peak RSS above the state:
    weights, gradients, AdamW moments, in bytes)"""
    import torch
    from llm import logprobs
    from plumbing import schedules
    import trainer
    from batch import GroupBatch
    checkpointing, micro_completions, dtype = option
    if checkpointing:
        logprobs.enable_activation_checkpointing(model)
    k, vocab = sequences, model.config.vocab_size
    batch = GroupBatch(prompt_ids=torch.randint(3, vocab, (1, prompt_len)),
                       prompt_mask=torch.ones(1, prompt_len, dtype=torch.long),
                       response_ids=torch.randint(3, vocab, (1, k, response_len)),
                       response_len=torch.full((1, k), response_len),
                       reward=torch.randn(1, k), ref_logp=torch.zeros(1, k),
                       version=torch.zeros(1, dtype=torch.long), prompt_index=torch.zeros(1, dtype=torch.long))
    optimizer, scheduler = schedules.make_optimizer(model, 1e-6, 100, 0, 0)
    # Keep the gradients allocated between steps, as part of the state: freed, they would be
    # re-allocated during backward and could set the peak without any activation alive.
    optimizer.zero_grad = functools.partial(type(optimizer).zero_grad, optimizer, set_to_none=False)
    extra = {} if option == OPTIONS["float32"] else dict(       # the old train_step has none
        micro_completions=micro_completions, dtype=getattr(torch, dtype))
    trainer.train_step(model, optimizer, scheduler, batch, beta=0.05, temperature=1.0,
                       micro_groups=None, max_grad_norm=1.0, **extra)
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    state = rss()
    reset_peak_rss()
    start = time.time()
    for _ in range(steps):
        trainer.train_step(model, optimizer, scheduler, batch, beta=0.05,
                           temperature=1.0, micro_groups=None, max_grad_norm=1.0, **extra)
    return (time.time() - start) / steps, peak_rss() - state


def arith(reps):
    sys.path.insert(0, str(REPO))
    import torch
    from llm import models
    from devices import placement
    from plumbing import schedules
    import trainer
    from batch import GroupBatch
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, _ = models.load_model(models.DEFAULT_MODEL)
    b, k, prompt_len, response_len, vocab = 4, 8, 60, 32, model.config.vocab_size
    batch = GroupBatch(prompt_ids=torch.randint(3, vocab, (b, prompt_len)),
                       prompt_mask=torch.ones(b, prompt_len, dtype=torch.long),
                       response_ids=torch.randint(3, vocab, (b, k, response_len)),
                       response_len=torch.full((b, k), response_len),
                       reward=torch.randn(b, k), ref_logp=torch.zeros(b, k),
                       version=torch.zeros(b, k, dtype=torch.long), prompt_index=torch.arange(b))
    optimizer, scheduler = schedules.make_optimizer(model, 1e-9, 1000, 0, 0)
    give_back = placement.release_freed_heap
    settings = {"all groups in one pass, freed heap kept": (None, lambda device: None),
                "all groups in one pass": (None, give_back),
                "2 groups a pass": (2, give_back), "1 group a pass": (1, give_back)}
    seconds, peaks = {name: [] for name in settings}, {name: [] for name in settings}
    for rep in range(reps + 1):
        for name, (micro_groups, after_step) in settings.items():
            reset_peak_rss()
            start = time.time()
            trainer.train_step(model, optimizer, scheduler, batch, beta=0.2, temperature=0.7,
                               micro_groups=micro_groups, max_grad_norm=1.0)
            after_step("cpu")                         # as tba.train does after each step
            if rep:                                   # the first round warms up
                seconds[name].append(time.time() - start)
                peaks[name].append((peak_rss(), rss()))
    print(f"| arith trainer step, one thread, {reps} rounds | s per step | ratio | peak RSS (GiB) "
          "| RSS after (GiB) |\n| --- | --- | --- | --- | --- |")
    first = statistics.mean(seconds[next(iter(settings))])
    for name in settings:
        mean = statistics.mean(seconds[name])
        print(f"| {name} | {mean:.1f} ± {statistics.stdev(seconds[name]):.1f} | {mean / first:.3f} "
              f"| {max(p for p, _ in peaks[name]) / GB:.2f} "
              f"| {max(a for _, a in peaks[name]) / GB:.2f} |")


def child(args):
    """One measurement in this fresh process; prints a JSON line."""
    sys.path.insert(0, args.repo)
    import torch
    torch.manual_seed(0)
    if args.what == "step":
        from llm import models
        model, _ = models.load_model(models.DEFAULT_MODEL)
        seconds, extra = measure_step(model, OPTIONS[args.option], 8, 200, 256, steps=2)
    else:
        from transformers import LlamaConfig, LlamaForCausalLM
        model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=args.layers, **LLAMA_1B)).eval()
        seconds, extra = measure_step(model, OPTIONS[args.option], args.sequences, 190,
                                      RECIPE_TOKENS - 190, steps=1)
    print(json.dumps({"seconds": seconds, "extra": extra}))


def in_fresh_process(*args, repo=REPO):
    out = subprocess.run([sys.executable, __file__, "_child", "--repo", str(repo), *map(str, args)],
                         cwd=REPO, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"error: the measurement {args} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(flags):
    import psutil
    out = REPO / "runs" / f"bench-memory-{time.strftime('%Y%m%d-%H%M%S')}"
    proc = subprocess.Popen([sys.executable, "tba.py", *flags, "--quiet", "--out", str(out)],
                            cwd=REPO)
    root = psutil.Process(proc.pid)
    peak_total, peak_pss, peak_each = 0, 0, {}
    while proc.poll() is None:
        try:
            tree = [root, *root.children(recursive=True)]
            full = {p.pid: p.memory_full_info() for p in tree}
        except psutil.Error:                     # a process ended between listing and reading
            continue
        now = {p.pid: (full[p.pid].rss, "trainer" if p is root else "searcher") for p in tree}
        peak_total = max(peak_total, sum(r for r, _ in now.values()))
        peak_pss = max(peak_pss, sum(m.pss for m in full.values()))
        for pid, (r, name) in now.items():
            peak_each[pid] = max(peak_each.get(pid, (0, name)), (r, name))
        time.sleep(0.2)
    if proc.returncode:
        sys.exit(f"error: the run failed with exit code {proc.returncode}")
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    step_s = statistics.mean(r["train_s"] for r in rows if "train_s" in r)
    big = sorted(((r, name) for r, name in peak_each.values() if r > 0.2 * GB), reverse=True)
    print(f"| python tba.py {' '.join(flags)} | {peak_total / GB:.2f} | {peak_pss / GB:.2f} | "
          + ", ".join(f"{name} {r / GB:.2f}" for r, name in big) + f" | {step_s:.1f} |")


def step(repo):
    print("| trainer step, SmolLM2-135M, K = 8 × 456 tokens | s per step | peak above the state (GiB) |"
          "\n| --- | --- | --- |")
    names = ["float32"] if repo != REPO else list(OPTIONS)
    for name in names:
        m = in_fresh_process("step", "--option", name, repo=repo)
        print(f"| {name}{' (' + str(repo) + ')' if repo != REPO else ''} | {m['seconds']:.1f} | "
              f"{m['extra'] / GB:.2f} |", flush=True)


def predict(only):
    """Fit extra = tokens·(a + b·layers) per option and predict the 22-layer recipe."""
    from transformers import LlamaConfig, LlamaForCausalLM
    import torch
    with torch.device("meta"):
        params = sum(p.numel() for p in LlamaForCausalLM(
            LlamaConfig(num_hidden_layers=LLAMA_1B_LAYERS, **LLAMA_1B)).parameters())
    print(f"1.1B Llama shape: {params / 1e9:.2f} B parameters\n")
    print("| option | bytes per token (all layers) | micro-batch (sequences of 700) | predicted "
          "trainer peak (GB) | fits 80 GB |\n| --- | --- | --- | --- | --- |")
    for name, (_, micro, dtype) in OPTIONS.items():
        if micro or (only and name != only):
            continue
        extra = {(layers, n): in_fresh_process("predict", "--option", name, "--layers", layers,
                                               "--sequences", n)["extra"]
                 for layers in LAYERS for n in SEQUENCES}
        (l1, l2), (n1, n2) = LAYERS, SEQUENCES
        per_token = {layers: (extra[layers, n2] - extra[layers, n1]) / ((n2 - n1) * RECIPE_TOKENS)
                     for layers in LAYERS}
        per_layer = (per_token[l2] - per_token[l1]) / (l2 - l1)        # b, bytes per token
        fixed = per_token[l1] - l1 * per_layer                          # a, bytes per token
        # A layer keeps at least its float32 input for backward; under checkpointing that is
        # all it keeps, below what the allocator's noise lets the fit resolve.
        bound = per_layer < LAYER_INPUT
        per_layer = max(per_layer, LAYER_INPUT)
        all_layers = fixed + per_layer * LLAMA_1B_LAYERS
        state = params * (16 + (2 if dtype != "float32" else 0))
        for sequences in (20, 4):                 # a whole group (K = 20), or 4 per pass
            peak = state + all_layers * RECIPE_TOKENS * sequences
            print(f"| {name} | {all_layers / 1e6:.2f} MB ({fixed / 1e3:.0f} kB + {LLAMA_1B_LAYERS} × "
                  f"{per_layer / 1e3:.0f} kB{', the bound' if bound else ''}) | {sequences} | {peak / 1e9:.1f} | "
                  f"{'yes' if peak < 80e9 else 'no'} |", flush=True)


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "_child":
        parser = argparse.ArgumentParser()
        parser.add_argument("what", choices=["step", "predict"])
        parser.add_argument("--repo", default=str(REPO))
        parser.add_argument("--option", choices=list(OPTIONS), default="float32")
        parser.add_argument("--layers", type=int, default=1)
        parser.add_argument("--sequences", type=int, default=1)
        return child(parser.parse_args(sys.argv[2:]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=["run", "step", "predict", "arith"])
    parser.add_argument("--reps", type=int, default=5, help="arith: rounds after the warm-up")
    parser.add_argument("--repo", type=Path, default=REPO,
                        help="step: measure the plain step of this checkout instead")
    parser.add_argument("--option", choices=list(OPTIONS), default="",
                        help="predict: this option only")
    args, _ = parser.parse_known_args()
    if args.what == "run":
        print("| run | peak RSS, all processes (GiB) | peak PSS, all processes (GiB) | RSS of each "
              "| trainer step (s) |\n| --- | --- | --- | --- | --- |")
        # argparse drops the "--" itself: find the tba.py flags after it in sys.argv
        run(sys.argv[sys.argv.index("--") + 1:] if "--" in sys.argv else RUN_DEFAULT)
    elif args.what == "step":
        step(args.repo.resolve())
    elif args.what == "arith":
        arith(args.reps)
    else:
        predict(args.option)


if __name__ == "__main__":
    main()
