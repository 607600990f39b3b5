"""`--device cuda`: a CPU-only torch, a CUDA torch that sees no GPU and a working one get other answers."""

from pathlib import Path

import pytest

from hetnode.cli.device import (
    CUDA_INDEX,
    TORCH_VERSION,
    check_device,
    cuda_problem,
    cuda_problem_here,
    resolve_device,
)
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


def test_auto_takes_cuda_only_where_it_can_run_and_cpu_and_cuda_are_as_asked():
    problem = cuda_problem_here()
    assert resolve_device("auto") == ("cuda" if problem is None else "cpu")
    assert resolve_device("cpu") == "cpu"
    if problem is None:
        assert resolve_device("cuda") == "cuda"
    else:
        with pytest.raises(ConfigError) as refused:
            resolve_device("cuda")
        assert refused.value.message == problem


def test_bootstrap_takes_the_device_flag_and_refuses_a_cuda_it_cannot_run(tmp_path: Path, capsys):
    from hetnode.cli.main import EXIT_USAGE, build_parser, main

    config = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"
    argv = ["bootstrap", "--config", str(config), "--data-dir", str(tmp_path / "data")]
    parser = build_parser()
    assert parser.parse_args(argv).device == "cpu"  # as before the flag: the coordinator on CPU
    assert parser.parse_args([*argv, "--device", "auto"]).device == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args([*argv, "--device", "tpu"])
    capsys.readouterr()
    if cuda_problem_here() is None:
        pytest.skip("this machine runs cuda: a refusal cannot be shown here")
    assert main([*argv, "--device", "cuda"]) == EXIT_USAGE
    assert f"hetnode: --device: {cuda_problem_here()}" in capsys.readouterr().err
    assert not (tmp_path / "data").exists()  # refused before anything was written
