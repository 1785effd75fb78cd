"""Weight sync: publish SmolLM2-135M's weights and load them in a searcher process, against a
plain memcpy of the same bytes in one process.

    python bench/weight_sync.py [--model PATH_OR_ID] [--repeats 10]

Publishing copies the trainer's parameters into a shared-memory slot; loading copies the slot
into the searcher's model. Each is one copy of every byte, so each is compared with one memcpy.
Goal: <= 2x. Prints one `name value unit` line per figure, then a markdown table.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from llm import models  # noqa: E402
from devices.weights import WeightChannel  # noqa: E402


def reader(model_name, channel, repeats, go, results):
    torch.set_num_threads(1)
    model, _ = models.load_model(model_name)
    version = channel.receive(model, 0, -1, block=True)
    results.put("ready")
    for _ in range(repeats):
        go.get(timeout=300)                      # the trainer has published: time only the load
        start = time.perf_counter()
        version = channel.receive(model, 0, version, block=True)
        results.put(time.perf_counter() - start)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=models.DEFAULT_MODEL)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, _ = models.load_model(args.model)
    ctx = mp.get_context("spawn")
    channel = WeightChannel(model, 1, ctx)
    n_bytes = sum(t.numel() * t.element_size() for t in channel.slots[0].values())
    channel.publish(model, 0)
    go, results = ctx.Queue(), ctx.Queue()
    process = ctx.Process(target=reader, args=(args.model, channel, args.repeats, go, results))
    process.start()
    assert results.get(timeout=300) == "ready"
    publish, load = [], []
    for version in range(1, args.repeats + 1):
        start = time.perf_counter()
        channel.publish(model, version)
        publish.append(time.perf_counter() - start)
        go.put(version)
        load.append(results.get(timeout=300))
    process.join()
    source = torch.ones(n_bytes, dtype=torch.uint8)
    target = torch.zeros_like(source)            # touched, so no page faults are timed
    memcpy = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        target.copy_(source)
        memcpy.append(time.perf_counter() - start)
    figures = {"weight_bytes_mb": n_bytes / 2**20,
               "publish_ms": 1000 * statistics.median(publish),
               "load_ms": 1000 * statistics.median(load),
               "memcpy_ms": 1000 * statistics.median(memcpy)}
    figures["publish_over_memcpy"] = figures["publish_ms"] / figures["memcpy_ms"]
    figures["load_over_memcpy"] = figures["load_ms"] / figures["memcpy_ms"]
    units = {"weight_bytes_mb": "MiB", "publish_over_memcpy": "x", "load_over_memcpy": "x"}
    for name, value in figures.items():
        print(f"{name} {value:.3f} {units.get(name, 'ms')}")
    print("\n| figure | value | goal |\n| --- | --- | --- |")
    for name, value in figures.items():
        goal = ("<= 2x " + ("(met)" if value <= 2 else "(missed)")) if name.endswith("memcpy") else ""
        print(f"| {name} | {value:.3f} {units.get(name, 'ms')} | {goal} |")


if __name__ == "__main__":
    main()
