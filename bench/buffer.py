"""Replay-buffer latency at GSM8K size: `add` and `sample` with 10,000 groups in the ring.

    python bench/buffer.py [--capacity 10000] [--group-size 8] [--prompt-len 256] [--response-len 512]

Goal: < 1 ms per call. Prints one `name value unit` line per figure, then a markdown table.
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
    parser.add_argument("--capacity", type=int, default=10_000)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--response-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=7, help="groups per sample (paper: 7 prompts)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    k, p, r = args.group_size, args.prompt_len, args.response_len
    buffer = ReplayBuffer(args.capacity, k, p, r)
    prompt = torch.randint(0, 49152, (p,))
    responses = torch.randint(0, 49152, (k, r))
    lengths = torch.full((k,), r)

    def add(version=[0]):
        version[0] += 1
        buffer.add(prompt, responses, lengths, torch.rand(k), -torch.rand(k) * 100,
                   -torch.rand(k) * 100, version[0] // 50, version[0])

    for _ in range(args.capacity):               # fill the ring
        add()
    generator = torch.Generator().manual_seed(0)
    rows = [
        ("buffer_add_ms", median_ms(add, 500)),
        ("buffer_sample_ms", median_ms(lambda: buffer.sample(args.batch, 0.95, None, generator), 200)),
        ("buffer_sample_priority_ms",
         median_ms(lambda: buffer.sample(args.batch, 0.5, 0.1, generator), 200)),
    ]
    for name, value in rows:
        print(f"{name} {value:.3f} ms")
    print(f"\n| figure ({len(buffer)} groups, K={k}, prompt {p}, response {r}, batch {args.batch}) "
          "| median | goal |\n| --- | --- | --- |")
    for name, value in rows:
        print(f"| {name} | {value:.3f} ms | < 1 ms {'(met)' if value < 1 else '(missed)'} |")


if __name__ == "__main__":
    main()
