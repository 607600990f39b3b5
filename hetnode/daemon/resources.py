"""What this machine offers: memory for a role and a quick compute figure for the layer split."""

from __future__ import annotations

import time
from pathlib import Path

import torch

CPU_MATMUL = 256
GPU_MATMUL = 4096
GPU_BATCH = 8  # matmuls queued between two waits


def available_memory_gb(device: str) -> float:
    if device == "cuda":
        free, _total = torch.cuda.mem_get_info()
        return free / 1e9
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024 / 1e9
    return 0.0


def measure_tflops(device: str, seconds: float = 0.3, size: int | None = None) -> float:
    """Matmul throughput in the precision training runs in, rounded to 2 significant digits so that noise
    rarely changes a split: fp32 on a CPU (256², what a CPU stage multiplies), bf16 on a GPU at 4096²
    (a small one is launch-bound and never reaches the tensor cores: a GPU would be misjudged by orders of
    magnitude and the layer split would hand its share of layers to a CPU)."""
    gpu = device.startswith("cuda")
    size = size or (GPU_MATMUL if gpu else CPU_MATMUL)
    dtype = torch.bfloat16 if gpu else torch.float32
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    torch.mm(a, b)  # warm-up (and, on a GPU, the kernel's selection)
    if gpu:
        torch.cuda.synchronize()
    count, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        torch.mm(a, b)
        count += 1
        if gpu and count % GPU_BATCH == 0:  # queue a batch, then wait: the clock sees compute, not launches
            torch.cuda.synchronize()
    if gpu:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    tflops = 2 * size**3 * count / elapsed / 1e12
    return float(f"{tflops:.2g}")
