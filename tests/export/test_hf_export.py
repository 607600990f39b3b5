"""An exported folder loads in stock transformers (no code of ours) and computes hetnode's logits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hetnode.cli.main import main
from hetnode.export.source import load_global_model, open_checkpoint

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-4
MEASURED: dict[str, float] = {}


def _tokens(vocab: int, length: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
@pytest.mark.parametrize("compression", ["none", "selective"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_exported_logits_match(
    small, write_checkpoint, bpe_path: Path, tmp_path: Path, tokenizer, compression, tied
):
    config = small(compression, tied, tokenizer)
    folder = write_checkpoint(config)
    out = tmp_path / "hf"
    argv = ["export", "--from", str(folder), "--format", "hf", "--out", str(out)]
    assert main(argv + (["--tokenizer", str(bpe_path)] if tokenizer == "bpe" else [])) == 0

    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, output_loading_info=True
    )
    assert type(hf).__name__ == "LlamaForCausalLM"
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensors
    doc = json.loads((out / "config.json").read_text())
    # tied in HF only when nothing is added at the input
    assert doc["tie_word_embeddings"] is (tied and compression == "none")
    assert hf.config.vocab_size == config.model.vocab_size
    assert hf.config.rope_parameters["rope_theta"] == config.model.rope_theta

    ours = load_global_model(open_checkpoint(str(folder)))
    tokens = _tokens(config.model.vocab_size, config.model.max_seq_len)
    with torch.no_grad():
        expected = ours(tokens)
        got = hf.eval()(input_ids=tokens).logits
    diff = float((got - expected).abs().max())
    MEASURED[f"{tokenizer}-{compression}-{'tied' if tied else 'untied'}"] = diff
    print(f"max |logit diff| {tokenizer}/{compression}/{'tied' if tied else 'untied'}: {diff:.3g}")
    assert expected.abs().max() > 1.0  # logits of order 1: a small diff means something
    assert diff <= TOLERANCE

    if compression != "none":  # leaving T_fix out of the export would be caught
        ours.fixed_embedding = None
        with torch.no_grad():
            assert float((ours(tokens) - got).abs().max()) > 100 * TOLERANCE


def test_greedy_generation_agrees(small, write_checkpoint, tmp_path: Path):
    """HF's greedy `generate` continues a prompt exactly as hetnode's sampler does at temperature 0."""
    from hetnode.model.sampling import sample_tokens

    config = small("selective", tied=True)
    folder = write_checkpoint(config)
    out = tmp_path / "hf"
    assert main(["export", "--from", str(folder), "--out", str(out)]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    prompt = tok("The river", return_tensors="pt")["input_ids"]
    generated = hf.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None)
    ours = sample_tokens(load_global_model(open_checkpoint(str(folder))), prompt[0].tolist(), 20, 0.0)
    assert generated[0, prompt.shape[1] :].tolist() == ours


def test_export_refuses_a_non_empty_folder(small, write_checkpoint, tmp_path: Path):
    folder = write_checkpoint(small("none", tied=False))
    out = tmp_path / "busy"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["export", "--from", str(folder), "--out", str(out)]) == 2
    assert main(["export", "--from", str(folder), "--out", str(out), "--force"]) == 0
    assert (out / "keep.txt").read_text() == "mine" and (out / "model.safetensors").is_file()


def test_export_of_what_is_not_a_checkpoint_exits_2(tmp_path: Path, capsys):
    """A path that names no checkpoint is the user's argument error: exit 2, naming what was there."""
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    assert main(["export", "--from", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "is not a checkpoint" in err and "found: notes.txt" in err
    assert main(["export", "--from", str(tmp_path / "absent"), "--out", str(tmp_path / "out")]) == 2
    assert "no such file or folder" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_damaged_local_checkpoint_exits_1(small, write_checkpoint, tmp_path: Path, capsys):
    """Exit 2 is for a URL's answer that no retry mends (and bad flags); a local folder's damage stays 1."""
    folder = write_checkpoint(small("none", tied=False))
    weights = bytearray((folder / "model.safetensors").read_bytes())
    weights[-4] ^= 1
    (folder / "model.safetensors").write_bytes(bytes(weights))
    assert main(["export", "--from", str(folder), "--out", str(tmp_path / "out")]) == 1
    assert "layer digests" in capsys.readouterr().err


def test_export_takes_the_newest_of_a_folder_of_checkpoints(small, write_checkpoint):
    config = small("none", tied=False)
    write_checkpoint(config, round_=3)
    newest = write_checkpoint(config, round_=12)
    assert open_checkpoint(str(newest.parent)).manifest.round == 12


def test_export_needs_no_transformers(small, write_checkpoint, tmp_path: Path):
    """With transformers unimportable (as where it is not installed), export still writes the folder."""
    folder = write_checkpoint(small("selective", tied=True))
    out = tmp_path / "hf"
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "from hetnode.cli.main import main\n"
        f"sys.exit(main(['export', '--from', {str(folder)!r}, '--out', {str(out)!r}]))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "transformers is not installed here" in done.stdout
    assert {p.name for p in out.iterdir()} >= {"model.safetensors", "config.json", "tokenizer.json"}
