"""One model, bit for bit, on any CPU (issue 15): θ⁰, T_fix, U and θ after two outer steps with α = 0.7 under
every aggregation rule are computed in separate processes under ATEN_CPU_CAPABILITY=default and under the best
capability of this machine (avx2/avx512 here), and must have the same digests. Before float64 generation and
an outer step that never fuses α·Δ into the subtraction, θ⁰ and T_fix differed and every later round."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from hetnode.algo.aggregate import AGGREGATION_RULES

SCRIPT = Path(__file__).with_name("portable_theta.py")


def digests_under(capability: str) -> dict:
    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability)
    result = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=300, env=env, check=True
    )
    return json.loads(result.stdout)


def test_theta_and_t_fix_and_outer_steps_do_not_depend_on_the_simd_path():
    best = torch.backends.cpu.get_cpu_capability().lower()
    plain, fast = digests_under("default"), digests_under(best)
    assert plain.pop("capability") == "DEFAULT"
    assert fast.pop("capability").lower() == best
    assert plain["init"] == fast["init"]
    assert plain["t_fix"] == fast["t_fix"] and plain["u"] == fast["u"]
    assert plain["after_two_steps"] == fast["after_two_steps"]  # under every aggregation rule
    assert plain["after_two_steps"].keys() == set(AGGREGATION_RULES)
    for digests in plain["after_two_steps"].values():
        assert digests != plain["init"]  # the steps moved θ
