"""Peak resident memory of a real run, all processes, next to what the weights need.

    python bench/memory.py [-- tba.py flags]       # default: 2 steps of GSM8K, one searcher

Samples the resident memory (RSS) of the trainer and every child process every 0.2 s and
reports the peak of their sum and of each process. For comparison: the policy's weights,
gradients and AdamW's two moments (4 × parameters × 4 bytes, float32) plus the frozen
reference model, all in the trainer, and policy + reference in each searcher.
"""
import subprocess
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import models  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# Issue 4's check that GSM8K runs on this machine; on a CPU it starts one searcher.
DEFAULT = ["--task", "gsm8k", "--data-dir", "../shared/data/gsm8k", "--steps", "2", "--eval-n", "16"]
GB = 1024 ** 3


def main():
    flags = sys.argv[sys.argv.index("--") + 1:] if "--" in sys.argv else DEFAULT
    out = REPO / "runs" / f"bench-memory-{time.strftime('%Y%m%d-%H%M%S')}"
    proc = subprocess.Popen([sys.executable, "tba.py", *flags, "--out", str(out)], cwd=REPO)
    root = psutil.Process(proc.pid)
    peak_total, peak_each = 0, {}
    while proc.poll() is None:
        try:
            tree = [root, *root.children(recursive=True)]
            rss = {p.pid: (p.memory_info().rss, "trainer" if p is root else f"child {p.pid}")
                   for p in tree}
        except psutil.Error:                     # a process ended between listing and reading
            continue
        peak_total = max(peak_total, sum(r for r, _ in rss.values()))
        for pid, (r, cmd) in rss.items():
            peak_each[pid] = max(peak_each.get(pid, (0, cmd)), (r, cmd))
        time.sleep(0.2)
    if proc.returncode:
        sys.exit(f"error: the run failed with exit code {proc.returncode}")
    model, _ = models.load_model(models.DEFAULT_MODEL)
    params = sum(p.numel() for p in model.parameters())
    trainer_need = 5 * params * 4            # weights, gradients, 2 AdamW moments, reference
    searcher_need = 2 * params * 4           # policy and reference
    big = [(r, cmd) for r, cmd in peak_each.values() if r > 0.2 * GB]   # skip helper processes
    print(f"memory_peak_total {peak_total / GB:.2f} GiB")
    for i, (r, cmd) in enumerate(sorted(big, reverse=True)):
        print(f"memory_peak_process_{i} {r / GB:.2f} GiB")
    print(f"memory_model_parameters {params / 1e6:.1f} M")
    print(f"memory_trainer_state {trainer_need / GB:.2f} GiB")
    print(f"\n| run: python tba.py {' '.join(flags)} | GiB |\n| --- | --- |")
    print(f"| peak RSS, all processes together | {peak_total / GB:.2f} |")
    for r, cmd in sorted(big, reverse=True):
        print(f"| peak RSS of the {cmd} (searchers are the large children) | {r / GB:.2f} |")
    print(f"| trainer: weights + gradients + AdamW moments + reference ({params / 1e6:.0f}M "
          f"parameters, float32) | {trainer_need / GB:.2f} |")
    print(f"| each searcher: policy + reference | {searcher_need / GB:.2f} |")


if __name__ == "__main__":
    main()
