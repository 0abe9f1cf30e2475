#!/usr/bin/env bash
# The floors setup.cfg declares for the trl and peft extras, checked: builds .venv-compat-extras with TRL
# and PEFT at those floors and everything else at CI's set (constraints-cpu.txt), prints what it got and
# runs the TRL drop-in's, LoRA's and the stages' tests that need no vLLM or Ray. The tests of features
# later releases added (PEFT 0.17's target_parameters and aLoRA, TRL 1.10's DistillationTrainer) skip
# there, saying so; a failure raises the floor. The range it passes is in the README.
#
#   scripts/compat_extras.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${COMPAT_VENV:-.venv-compat-extras}"
PY="${PYTHON:-python3}"
export RLHF_CACHE_DIR="${RLHF_CACHE_DIR:-$PWD/.cache/rlhf-compat}"
export RLHF_DISABLE_PLUGIN_AUTOLOAD=1

UV="$(command -v uv || true)"
if [ -z "$UV" ]; then
  [ -x .cache/uv-venv/bin/uv ] || { "$PY" -m venv .cache/uv-venv && .cache/uv-venv/bin/pip install --quiet uv; }
  UV=.cache/uv-venv/bin/uv
fi
floor() { sed -n "s/^ *$1>=\([0-9.]*\).*/\1/p" setup.cfg | head -1; }
rm -rf "$VENV"
"$UV" venv --quiet -p "$PY" "$VENV"
CONSTRAINTS="$VENV/constraints.txt"
{ grep -vE "^(trl|peft)==" constraints-cpu.txt; echo "trl==$(floor trl)"; echo "peft==$(floor peft)"; } > "$CONSTRAINTS"
"$UV" pip install --quiet -p "$VENV/bin/python" -c "$CONSTRAINTS" -e ".[test,trl,peft,math]"
"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md

print("compat environment:", ", ".join(f"{p} {md.version(p)}" for p in ("trl", "peft", "transformers", "torch")))
EOF
"$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/test_trl_peft.py tests/test_trl_rloo.py \
  tests/test_stages.py -k "not vllm and not ray"
