"""What this machine offers: memory for a role and a quick compute figure for the layer split."""

from __future__ import annotations

import time
from pathlib import Path

import torch


def available_memory_gb(device: str) -> float:
    if device == "cuda":
        free, _total = torch.cuda.mem_get_info()
        return free / 1e9
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024 / 1e9
    return 0.0


def measure_tflops(device: str, seconds: float = 0.3, size: int = 256) -> float:
    """fp32 matmul throughput, rounded to 2 significant digits so that noise rarely changes a split."""
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    torch.mm(a, b)  # warm-up
    count, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        torch.mm(a, b)
        count += 1
    if device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    tflops = 2 * size**3 * count / elapsed / 1e12
    return float(f"{tflops:.2g}")
