#!/usr/bin/env bash
# Wheels the lent GPU machine lacks (its image: torch 2.11+cu130, transformers, peft, accelerate, pluggy,
# pyarrow, rich, safetensors, tensorboard ...; no vllm, ray, deepspeed, trl, datasets; no network), for
# CPython 3.12 on x86_64, into .whl/ -- git-ignored, carried to the device by the device tool (64 MiB
# per call in all) and installed there by scripts/device_check.sh with pip --no-index.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${WHEELHOUSE:-.whl}"
PY="${PYTHON:-.venv/bin/python}"
version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
rm -rf "$OUT" && mkdir -p "$OUT"
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
           --platform manylinux1_x86_64)
download() {
    "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${PLATFORMS[@]}" -d "$OUT" "$@"
}
# this project (pure Python; the tiny default and tool models ship inside it)
"$PY" -m pip wheel --quiet --no-deps --no-build-isolation -w "$OUT" .
# DeepSpeed is a source distribution: built here with its CUDA ops off (they JIT-compile there if asked for)
DS_BUILD_OPS=0 "$PY" -m pip wheel --quiet --no-deps --no-binary deepspeed -w "$OUT" "deepspeed==$(version deepspeed)"
# TRL and datasets for the TRL side of bench/gpu.py; DeepSpeed's and datasets' small dependencies the image lacks;
# the same versions as this machine's tested environment
download "trl==$(version trl)" "datasets==$(version datasets)" "dill==$(version dill)" \
    "multiprocess==$(version multiprocess)" "hjson==$(version hjson)" "pydantic==$(version pydantic)" \
    "pydantic-core==$(version pydantic_core)" "annotated-types==$(version annotated-types)" \
    "typing-inspection==$(version typing-inspection)"
ls "$OUT"
size=$(du -sm "$OUT" | cut -f1)
echo "wheelhouse: $size MiB in $OUT"
if [ "$size" -ge 48 ]; then
    echo "the wheelhouse is over 48 MiB: with the working tree it would not fit the device's 64 MiB" >&2
    exit 1
fi
