"""Default model preparation and model-folder verification."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdd.config import ModelConfig
from pdd.engine.model import MANIFEST, _write_manifest, prepare_model, verify_model
from pdd.errors import ModelError


def fake_folder(tmp_path: Path) -> Path:
    """A small model-shaped folder with a pdd manifest (no real weights)."""
    folder = tmp_path / "m"
    folder.mkdir()
    for name, data in {
        "config.json": b"{}",
        "tokenizer.json": b"{}",
        "tokenizer_config.json": b"{}",
        "model.safetensors": b"x" * 1000,
    }.items():
        (folder / name).write_bytes(data)
    _write_manifest(folder, "bfloat16")
    return folder


def test_verify_accepts_a_complete_folder(tmp_path: Path) -> None:
    folder = fake_folder(tmp_path)
    manifest = verify_model(folder, deep=True)
    assert manifest["dtype"] == "bfloat16"
    assert manifest["files"]["model.safetensors"]["size"] == 1000


def test_verify_detects_truncated_weights(tmp_path: Path) -> None:
    folder = fake_folder(tmp_path)
    (folder / "model.safetensors").write_bytes(b"x" * 10)
    with pytest.raises(ModelError, match=f"{folder}: model.safetensors has the wrong size"):
        verify_model(folder)


def test_deep_verify_detects_flipped_bytes(tmp_path: Path) -> None:
    folder = fake_folder(tmp_path)
    (folder / "model.safetensors").write_bytes(b"y" * 1000)  # same size, other bytes
    verify_model(folder)  # the quick check only looks at sizes
    with pytest.raises(ModelError, match="sha256"):
        verify_model(folder, deep=True)


def test_verify_detects_missing_files_and_folders(tmp_path: Path) -> None:
    folder = fake_folder(tmp_path)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ModelError, match="missing file tokenizer.json"):
        verify_model(folder)
    with pytest.raises(ModelError, match="model folder not found"):
        verify_model(tmp_path / "nope")
    (folder / MANIFEST).write_text("{not json")
    with pytest.raises(ModelError, match=f"{folder}: unreadable"):
        verify_model(folder)


def test_user_folder_without_manifest_needs_weights(tmp_path: Path) -> None:
    folder = fake_folder(tmp_path)
    (folder / MANIFEST).unlink()
    assert verify_model(folder)["files"] == {"model.safetensors": {}}
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelError, match=r"missing \*\.safetensors"):
        prepare_model(ModelConfig(path=folder))


def test_explicit_path_is_returned_as_is(tmp_path: Path) -> None:
    folder = fake_folder(tmp_path)
    assert prepare_model(ModelConfig(path=folder)) == folder


def test_import_is_cheap() -> None:
    code = "import sys, pdd.engine.model; print('torch' in sys.modules, 'vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_resolved_path_convention() -> None:
    cfg = ModelConfig(cache_dir=Path("/c"))  # float32: the default
    assert cfg.resolved_path() == Path("/c/SmolLM2-135M-Instruct-float32")
    bf16 = ModelConfig(cache_dir=Path("/c"), dtype="bfloat16")
    assert bf16.resolved_path() == Path("/c/SmolLM2-135M-Instruct-bfloat16")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_default_model_is_prepared_once_and_answers_paris(dtype: str) -> None:
    cfg = ModelConfig(dtype=dtype)
    path = prepare_model(cfg)  # builds it on a fresh machine (~25 s)
    built = [(f.name, f.stat().st_ino, f.stat().st_mtime_ns) for f in sorted(path.iterdir())]
    assert prepare_model(cfg) == path == cfg.resolved_path()
    # The second call only checked the folder: the same files, none rewritten.
    assert [
        (f.name, f.stat().st_ino, f.stat().st_mtime_ns) for f in sorted(path.iterdir())
    ] == built
    manifest = verify_model(path, deep=True)
    assert manifest["dtype"] == dtype
    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config
    assert (config["num_hidden_layers"], config["num_key_value_heads"]) == (30, 3)
    tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
    assert tok_cfg["chat_template"].startswith("{% for message in messages %}")
    assert (tok_cfg["eos_token"], tok_cfg["bos_token"]) == ("<|im_end|>", "<|im_start|>")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.dtype == getattr(torch, dtype)
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    assert ids.tolist() == [[504, 3575, 282, 4649, 314]]
    out = model.generate(ids, max_new_tokens=2, do_sample=False)
    assert tok.decode(out[0, ids.shape[1] :]) == " Paris."
