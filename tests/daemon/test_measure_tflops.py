"""The compute figure a peer advertises (and the layer split follows) is measured in the precision it
trains in; on a CPU, fp32 at the size a CPU stage multiplies."""

from __future__ import annotations

import pytest
import torch

from hetnode.daemon.resources import measure_tflops


def test_a_cpu_figure_is_positive_and_rounded_to_two_digits():
    tflops = measure_tflops("cpu", seconds=0.05)
    assert tflops > 0
    assert float(f"{tflops:.2g}") == tflops


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: checked by benchmarks/gpu_check.sh")
def test_a_gpu_is_measured_in_bf16_far_above_a_cpu():
    assert measure_tflops("cuda", seconds=0.2) > 10 * measure_tflops("cpu", seconds=0.05)
