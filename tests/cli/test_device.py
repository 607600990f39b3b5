"""`--device cuda`: a CPU-only torch, a CUDA torch that sees no GPU and a working one get other answers."""

from pathlib import Path

import pytest

from hetnode.cli.device import CUDA_INDEX, TORCH_VERSION, check_device, cuda_problem
from hetnode.errors import ConfigError


@pytest.mark.parametrize(
    ("cuda_build", "device_count", "says"),
    [
        (None, 0, ["CPU-only build", f"torch=={TORCH_VERSION} --index-url {CUDA_INDEX}", "--device cpu"]),
        (None, 2, ["CPU-only build"]),  # no count makes a CPU build run CUDA
        ("12.6", 0, ["CUDA 12.6 build", "sees no GPU", "nvidia-smi", "CUDA_VISIBLE_DEVICES"]),
        ("12.6", -1, ["sees no GPU"]),
        ("12.6", 1, None),
        ("13.0", 8, None),
    ],
)
def test_cuda_problem(cuda_build, device_count, says):
    problem = cuda_problem(cuda_build, device_count)
    if says is None:
        assert problem is None
    else:
        assert problem is not None
        for words in says:
            assert words in problem
    if cuda_build is not None:  # a CUDA build is never told to install the CUDA build
        assert problem is None or "--index-url" not in problem


def test_the_pinned_torch_is_the_makefile_pin():
    makefile = (Path(__file__).resolve().parents[2] / "Makefile").read_text()
    assert f"torch=={TORCH_VERSION}" in makefile  # the version `make` installs, from whichever index


def test_cpu_is_always_allowed_and_cuda_is_checked_here():
    import torch

    check_device("cpu")
    if torch.version.cuda is None:  # this machine's torch: the answer names the CPU-only build
        with pytest.raises(ConfigError, match="CPU-only build"):
            check_device("cuda")


def test_the_readme_installs_what_the_message_names():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert f"pip install torch=={TORCH_VERSION} --index-url {CUDA_INDEX}" in readme
