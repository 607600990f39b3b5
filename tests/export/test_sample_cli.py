"""`hetnode sample` as a user runs it: a real subprocess on a checkpoint folder."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hetnode.cli.main import main
from hetnode.data.tokenizer import ByteTokenizer
from hetnode.export.source import load_global_model, open_checkpoint
from hetnode.model.sampling import sample_tokens

PROMPT = "The river"


def _sample(folder: Path, *flags: str) -> str:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "hetnode.cli.main",
            "sample",
            "--from",
            str(folder),
            "--prompt",
            PROMPT,
            *flags,
        ],
        capture_output=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    assert done.stdout.endswith(b"\n")
    return done.stdout[:-1].decode("utf-8")  # bytes: text mode would turn a sampled "\r" into "\n"


@pytest.fixture
def checkpoint(small, write_checkpoint) -> Path:
    return write_checkpoint(small("selective", tied=False))


def test_a_seed_repeats_its_sample_and_greedy_is_the_argmax(checkpoint: Path):
    model = load_global_model(open_checkpoint(str(checkpoint)))
    prompt = ByteTokenizer().encode(PROMPT)

    seeded = _sample(checkpoint, "--tokens", "24", "--temperature", "1.0", "--seed", "3")
    draws = sample_tokens(model, prompt, 24, 1.0, seed=3, stop_id=ByteTokenizer.eos_id)
    assert seeded == ByteTokenizer().decode(draws)  # the same text in another process: seeded
    assert draws != sample_tokens(model, prompt, 24, 1.0, seed=4, stop_id=ByteTokenizer.eos_id)

    greedy = _sample(checkpoint, "--tokens", "24", "--temperature", "0")
    ids, expected = list(prompt), []
    with torch.no_grad():
        for _ in range(24):  # the argmax continuation, step by step, without the sampler
            token = int(model(torch.tensor([ids]))[0, -1].argmax())
            if token == ByteTokenizer.eos_id:
                break
            ids.append(token)
            expected.append(token)
    assert greedy == ByteTokenizer().decode(expected)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tokens", "0"], "--tokens"),
        (["--tokens", "4097"], "--tokens"),
        (["--temperature", "-1"], "--temperature"),
        (["--temperature", "nan"], "--temperature"),
        (["--temperature", "inf"], "--temperature"),
        (["--seed", "-1"], "--seed"),
    ],
)
def test_bad_flags_are_usage_errors(checkpoint: Path, flags: list[str], message: str, capsys):
    assert main(["sample", "--from", str(checkpoint), "--prompt", PROMPT, *flags]) == 2
    assert message in capsys.readouterr().err


def test_a_prompt_of_no_tokens_is_a_usage_error(checkpoint: Path, capsys):
    assert main(["sample", "--from", str(checkpoint), "--prompt", ""]) == 2
    assert "encodes to no tokens" in capsys.readouterr().err


def test_sampling_what_is_not_a_checkpoint_exits_1(tmp_path: Path, capsys):
    assert main(["sample", "--from", str(tmp_path), "--prompt", PROMPT]) == 1
    assert "not a hetnode checkpoint" in capsys.readouterr().err
