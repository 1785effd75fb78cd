"""The precision scheme of every process: float32 weights, gradients and optimiser state, forward
passes under autocast to --dtype, and how --dtype auto chooses on a CPU."""
import time

import torch


def autocast(device, dtype):
    """Forward passes in `dtype` (bfloat16, float16) over float32 weights, or plain float32.

    The precision scheme of every process: the trainer's weights, gradients and AdamW moments
    stay float32 (an update of lr 1e-6 is below bfloat16's resolution of a weight near 1), and
    matmuls run in `dtype`. Searchers run the same casts, so they sample and score with the
    same numbers as the trainer. Enter it per forward pass or `generate` call, never around a
    loop: autocast caches its low-precision copies of the weights until the context exits.
    """
    return torch.autocast(torch.device(device).type, dtype=dtype, enabled=dtype != torch.float32)


def cpu_bfloat16_is_faster(size=512, repeats=3):
    """Does this CPU multiply in bfloat16 natively (oneDNN's check: AVX-512 BF16 or AMX) and
    measurably faster than in float32? Without native support bfloat16 is emulated: on an AMD
    EPYC with AVX2 a 2048³ matmul ran at under 1 GFLOP/s against 187 in float32
    (bench/roofline.py), while on an Intel Xeon with AMX autocast was 1.5× faster."""
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    a, b = torch.randn(size, size), torch.randn(size, size)
    seconds = {}
    for dtype in (torch.float32, torch.bfloat16):
        x, y = a.to(dtype), b.to(dtype)
        x @ y
        seconds[dtype] = min(_seconds(lambda: x @ y) for _ in range(repeats))
    return seconds[torch.bfloat16] < 0.8 * seconds[torch.float32]


def _seconds(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
