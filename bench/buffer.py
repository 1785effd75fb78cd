"""Replay-buffer latency at GSM8K size: `add` a group and `sample` B groups with 50,000
completions stored (7,473 prompts, at most 100 each).

    python bench/buffer.py [--capacity 50000] [--prompts 7473] [--per-prompt 100] [--batch 16]

Goal: a draw of 16 groups under 2 ms. Prints one `name value unit` line per figure, then a
markdown table.
"""
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from buffer import ReplayBuffer  # noqa: E402


def median_ms(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * sorted(times)[len(times) // 2]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--capacity", type=int, default=50_000, help="completions")
    parser.add_argument("--prompts", type=int, default=7473, help="GSM8K's training prompts")
    parser.add_argument("--per-prompt", type=int, default=100, help="TBA's cap per prompt")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--response-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=16, help="groups per draw")
    args = parser.parse_args()
    torch.set_num_threads(1)
    k, p, r = args.group_size, args.prompt_len, args.response_len
    buffers = {evict: ReplayBuffer(args.capacity, k, p, r, n_prompts=args.prompts,
                                   per_prompt=args.per_prompt, evict=evict, dedup=dedup)
               for evict, dedup in (("oldest", False), ("lowest", True))}
    prompt = torch.randint(0, 49152, (p,))
    lengths = torch.full((k,), r)

    def add(buffer, count=[0]):
        count[0] += 1
        buffer.add(prompt, torch.randint(0, 49152, (k, r)), lengths, torch.rand(k),
                   -torch.rand(k) * 100, -torch.rand(k) * 100, count[0] // 50,
                   count[0] % args.prompts)

    for buffer in buffers.values():
        while len(buffer) < args.capacity:
            add(buffer)
    generator = torch.Generator().manual_seed(0)
    oldest, lowest = buffers["oldest"], buffers["lowest"]
    rows = [
        ("buffer_add_group_ms", median_ms(lambda: add(oldest), 300)),
        ("buffer_add_group_lowest_dedup_ms", median_ms(lambda: add(lowest), 300)),
        ("buffer_sample_ms", median_ms(lambda: oldest.sample(args.batch, 0.5, None, generator), 200)),
        ("buffer_sample_priority_ms",
         median_ms(lambda: oldest.sample(args.batch, 0.5, 1.0, generator), 200)),
    ]
    for name, value in rows:
        print(f"{name} {value:.3f} ms")
    print(f"\n| figure ({len(oldest)} completions of {args.prompts} prompts, K={k}, prompt {p}, "
          f"response {r}, {args.batch} groups a draw) | median | goal |\n| --- | --- | --- |")
    for name, value in rows:
        goal = f"< 2 ms {'(met)' if value < 2 else '(missed)'}" if "sample" in name else "-"
        print(f"| {name} | {value:.3f} ms | {goal} |")


if __name__ == "__main__":
    main()
