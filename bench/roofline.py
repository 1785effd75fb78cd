"""How far each phase of a trainer step is from what this machine can do.

    python bench/roofline.py                   # arith's step: SmolLM2-135M, B = 4 prompts, K = 8
    python bench/roofline.py --repo DIR        # the same phases run by another checkout's code

First the machine's limits: the matmul throughput of a large float32 (2048³) and bfloat16
(512³) matmul (GFLOP/s, all threads), and the memory bandwidth of a large copy (GB/s). Then the phases of one
synchronous step of `--task arith`, each timed with the project's own functions on the same
prompts and seed (the best of --repeats):

    generation   sampling.generate: K samples for each of B prompts (prefill and decode)
    scoring      the reference log-probs of the B·K completions (sample_groups minus generation)
    train        trainer.train_step's forward and backward (its optimiser step timed apart)
    optimiser    AdamW's update of every parameter
    evaluation   greedy answers to --eval-batch test prompts (one batch of an evaluation)

and the work each phase *needs*: 2 FLOPs per parameter per token through the decoder, the output
layer's 2·V·H where a token's logits are used, 4·layers·H per token per token of context in
attention; backward twice the forward. "Needed" counts each prompt once per group, responses
only up to their lengths, no recomputation: what a step must do, whatever the code does. A
phase's limit is the larger of its FLOPs at the matmul rate and the bytes it must move (each
decode step reads every weight once) at the copy rate; "of limit" is that time over the
measured one, and the rest of the time is padding, recomputation, repeated prompts, Python and
framework overhead, and matmuls smaller than the measured one.
"""
import argparse
import copy
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def matmul_rate(dtype, n=2048, repeats=5):
    """GFLOP/s of an n×n by n×n matmul in `dtype`, the best of `repeats`."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    best = min(timed(lambda: a @ b) for _ in range(repeats))
    return 2 * n ** 3 / best / 1e9


def copy_rate(mb=512, repeats=5):
    """GB/s of a copy of `mb` MB: it reads and writes each byte once."""
    src = torch.empty(mb * 2 ** 20 // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    best = min(timed(lambda: dst.copy_(src)) for _ in range(repeats))
    return 2 * src.numel() * 4 / best / 1e9


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def flops_per_token(model, context, logits=True):
    """Forward FLOPs of one token with `context` tokens before it (itself included)."""
    config = model.config
    embed = model.get_input_embeddings().weight.numel()
    body = sum(p.numel() for p in model.parameters()) - embed          # the head is tied to it
    head = model.get_output_embeddings().weight.numel()
    return 2 * body + (2 * head if logits else 0) + 4 * config.num_hidden_layers * config.hidden_size * context


def sequence_flops(model, prompt_len, response_len, forward_only=True):
    """Forward (or forward + backward) FLOPs of one prompt and its completions, each prompt token
    once, each response token with its own context, logits for the response tokens only."""
    total = sum(flops_per_token(model, t + 1, logits=False) for t in range(prompt_len))
    for r in response_len:
        total += sum(flops_per_token(model, prompt_len + t + 1) for t in range(r))
    return total if forward_only else 3 * total


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repo", default=str(REPO), help="the checkout whose code runs")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each phase; the best counts")
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed runs first: a train step takes 18 s, then 14, 11, 10.4 while "
                             "the allocator settles")
    parser.add_argument("--eval-batch", type=int, default=16, help="test prompts of the evaluation phase")
    parser.add_argument("--json", help="also write the numbers to this file")
    args = parser.parse_args()
    sys.path.insert(0, args.repo)
    from llm import sampling
    import searcher
    import tasks
    from plumbing import schedules
    import trainer
    settings = __import__("config" if (Path(args.repo) / "config.py").exists() else "tba")
    cfg = settings.resolve(settings.parse_args(["--task", "arith", "--searchers", "0"])[0])
    torch.set_num_threads(2)
    # bfloat16 at 512³: without native support it runs at under 1 GFLOP/s, a minute at 2048³
    limits = {"float32": matmul_rate(torch.float32), "bfloat16": matmul_rate(torch.bfloat16, n=512),
              "copy": copy_rate()}
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} "
          f"threads; torch {torch.__version__}; code: {args.repo}")
    print(f"matmul: float32 (2048³) {limits['float32']:.0f} GFLOP/s, bfloat16 (512³) "
          f"{limits['bfloat16']:.3g} GFLOP/s; copy {limits['copy']:.1f} GB/s")

    task = tasks.make_task(cfg)
    policy, tokenizer = task.load_model(torch.device("cpu"))
    ref_model = copy.deepcopy(policy).requires_grad_(False)
    prompts = task.prompts("train", tokenizer)[:cfg.prompts_per_step]
    b, k = cfg.prompts_per_step, cfg.group_size
    weight_bytes = sum(p.numel() * p.element_size() for p in policy.parameters())
    times = {name: [] for name in ("generation", "search", "train", "optimiser", "evaluation")}
    optimizer, scheduler = schedules.make_optimizer(policy, cfg.lr, 100, 0, 0)
    step, optimiser_s = optimizer.step, []

    def timed_step(*a, **kw):
        start = time.perf_counter()
        out = step(*a, **kw)
        optimiser_s.append(time.perf_counter() - start)
        times["optimiser"].append(optimiser_s[-1])
        return out
    optimizer.step = timed_step
    test = task.prompts("test", tokenizer)[:args.eval_batch]
    for repeat in range(-args.warmup, args.repeats):
        if repeat == 0:                                    # the warm-up runs do not count
            times = {name: [] for name in times}
        torch.manual_seed(0)
        times["generation"].append(timed(lambda: sampling.generate(
            policy, tokenizer, [p.ids for p in prompts], num_samples=k,
            max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature)))
        torch.manual_seed(0)
        start = time.perf_counter()
        batch, _ = searcher.sample_groups(policy, ref_model, tokenizer, task, prompts, k,
                                          cfg.max_new_tokens, cfg.temperature)
        times["search"].append(time.perf_counter() - start)
        start = time.perf_counter()
        trainer.train_step(policy, optimizer, scheduler, batch, beta=cfg.beta,
                           temperature=cfg.temperature, micro_groups=cfg.micro_groups,
                           max_grad_norm=cfg.max_grad_norm)
        times["train"].append(time.perf_counter() - start - optimiser_s[-1])
        times["evaluation"].append(timed(lambda: sampling.generate(
            policy, tokenizer, [p.ids for p in test], max_new_tokens=cfg.max_new_tokens,
            greedy=True)))
    best = {name: min(t) for name, t in times.items()}
    best["scoring"] = best.pop("search") - best["generation"]

    prompt_len = [len(p.ids) for p in prompts]
    response_len = batch.response_len.tolist()                                  # [B][K]
    decode_steps = batch.response_ids.shape[-1]
    needed = {    # FLOPs, bytes
        "generation": (sum(sequence_flops(policy, p, r) for p, r in zip(prompt_len, response_len)),
                       decode_steps * weight_bytes),
        "scoring": (sum(sequence_flops(policy, p, r) for p, r in zip(prompt_len, response_len)), 0),
        "train": (sum(sequence_flops(policy, p, r, forward_only=False)
                      for p, r in zip(prompt_len, response_len)), 0),
        "optimiser": (12 * sum(p.numel() for p in policy.parameters()), 7 * weight_bytes),
        "evaluation": (sum(sequence_flops(policy, len(p.ids), [cfg.max_new_tokens]) for p in test),
                       cfg.max_new_tokens * weight_bytes),
    }
    rows = []
    print(f"\narith step: B = {b}, K = {k}, prompts of {statistics.median(prompt_len):.0f} "
          f"tokens (median), responses of {sum(map(sum, response_len)) / (b * k):.1f} (mean) "
          f"and at most {decode_steps}; float32; best of {args.repeats}")
    print("| phase | time (s) | needed GFLOP | GFLOP/s | of float32 matmul | limit (s) | of limit |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in ("generation", "scoring", "train", "optimiser", "evaluation"):
        flops, moved = needed[name]
        limit = max(flops / (limits["float32"] * 1e9), moved / (limits["copy"] * 1e9))
        rate = flops / best[name] / 1e9
        rows.append({"phase": name, "time_s": best[name], "gflop": flops / 1e9, "limit_s": limit})
        print(f"| {name} | {best[name]:.2f} | {flops / 1e9:.0f} | {rate:.0f} | "
              f"{rate / limits['float32']:.0%} | {limit:.2f} | {limit / best[name]:.0%} |")
    step_s = sum(best[n] for n in ("generation", "scoring", "train", "optimiser"))
    print(f"a synchronous step (generation + scoring + train + optimiser): {step_s:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"limits": limits, "phases": rows, "step_s": step_s,
                                               "repo": args.repo}, indent=2))


if __name__ == "__main__":
    main()
