#!/usr/bin/env bash
# The floors setup.cfg declares for the trl, peft, deepspeed and ray extras, checked: builds
# .venv-compat-extras with TRL, PEFT, DeepSpeed and Ray at those floors and everything else at CI's set
# (constraints-cpu.txt), prints what it got and runs the TRL drop-in's, LoRA's and the stages' tests that
# need no vLLM or Ray, then DeepSpeed's learner tests and its ZeRO-2 / ZeRO-3-on-Ray resume and ZeRO-3
# EMA tests. The tests of features later releases added (PEFT 0.17's target_parameters and aLoRA, TRL
# 1.10's DistillationTrainer) skip there, saying so; a failure raises the floor. The range it passes is in
# the README.
#
#   scripts/compat_extras.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${COMPAT_VENV:-.venv-compat-extras}"
PY="${PYTHON:-python3}"
source scripts/compat_venv.sh
floor() { sed -n "s/^ *$1>=\([0-9.]*\).*/\1/p" setup.cfg | head -1; }
CONSTRAINTS="$VENV/constraints.txt"
{ grep -vE "^(trl|peft|deepspeed|ray)==" constraints-cpu.txt
  for p in trl peft deepspeed; do echo "$p==$(floor "$p")"; done; echo "ray==$(floor 'ray\[default\]')"; } > "$CONSTRAINTS"
"$UV" pip install --quiet -p "$VENV/bin/python" -c "$CONSTRAINTS" -e ".[test,trl,peft,math,deepspeed,ray]"
"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md

print("compat environment:", ", ".join(f"{p} {md.version(p)}" for p in
      ("trl", "peft", "deepspeed", "ray", "accelerate", "transformers", "torch")))
EOF
"$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/test_trl_peft.py tests/test_trl_rloo.py \
  tests/test_stages.py -k "not vllm and not ray"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/test_deepspeed_learner.py \
  tests/test_faults_and_resume_at_scale.py tests/test_ema.py -k "deepspeed_learner or zero"
