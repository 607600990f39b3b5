"""`--device cuda`: refused with its fix when it cannot run; a CPU-only torch is not a missing GPU.
`--device auto` (`hetnode bootstrap`): cuda where it can run, else cpu."""

from __future__ import annotations

from hetnode.errors import ConfigError

# The torch that `make` and the README pin; the CUDA build of the same version comes from a CUDA wheel index.
TORCH_VERSION = "2.13.0"
CUDA_INDEX = "https://download.pytorch.org/whl/cu126"


def cuda_problem(cuda_build: str | None, device_count: int) -> str | None:
    """Why `--device cuda` cannot run, with what to do about it; None when it can.

    `cuda_build` is `torch.version.cuda` (None: a CPU-only build of torch), `device_count` the GPUs that
    build can use (0: a CUDA build that sees no GPU, because of the driver or of what is made visible)."""
    if cuda_build is None:
        return (
            "cuda requested but this torch is a CPU-only build (torch.version.cuda is None): install the "
            f"CUDA build into this environment, pip install torch=={TORCH_VERSION} --index-url {CUDA_INDEX} "
            "(an index of a CUDA version your driver supports, see nvidia-smi), or use --device cpu"
        )
    if device_count <= 0:
        return (
            f"cuda requested and torch is a CUDA {cuda_build} build, but it sees no GPU: check the NVIDIA "
            f"driver (nvidia-smi; it must support CUDA {cuda_build}) and CUDA_VISIBLE_DEVICES (in a "
            "container: --gpus), or use --device cpu"
        )
    return None


def cuda_problem_here() -> str | None:
    """`cuda_problem` of this machine's torch and GPUs."""
    import torch

    build = torch.version.cuda
    # is_available() is False when the driver is missing or older than the build, whatever the count says
    count = torch.cuda.device_count() if build is not None and torch.cuda.is_available() else 0
    return cuda_problem(build, count)


def check_device(device: str) -> None:
    """Raise ConfigError (exit code 2) when `device` is cuda and this machine cannot run it."""
    if device != "cuda":
        return
    problem = cuda_problem_here()
    if problem is not None:
        raise ConfigError("--device", "device", problem)


def resolve_device(device: str) -> str:
    """The device `--device cpu|cuda|auto` runs on: cpu; cuda, checked as `check_device` does; auto: cuda
    where it can run, else cpu."""
    if device == "auto":
        return "cuda" if cuda_problem_here() is None else "cpu"
    check_device(device)
    return device
