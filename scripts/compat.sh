#!/usr/bin/env bash
# The oldest versions setup.cfg admits, checked: builds .venv-compat with uv's lowest-direct
# resolution (every direct requirement of the core install at its declared floor: torch,
# transformers, tokenizers, datasets, ...), prints what it got, trains the README's default run
# and runs the tests of the model code (engine, caches, packing, learners, every estimator).
# A floor that fails here is raised in setup.cfg; the range it passes is in the README.
#
#   scripts/compat.sh            # the floors
#   COMPAT_RESOLUTION=highest scripts/compat.sh   # the newest releases, the other end, with TRL and
#                                # math-verify too and the TRL drop-in's and stages' tests that need no vLLM
#                                # or Ray (a transformers release renaming a TrainingArguments field shows there)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${COMPAT_VENV:-.venv-compat}"
PY="${PYTHON:-python3}"
RESOLUTION="${COMPAT_RESOLUTION:-lowest-direct}"
source scripts/compat_venv.sh
EXTRAS=test,peft
if [ "$RESOLUTION" = highest ]; then EXTRAS=test,peft,trl,math; fi
"$UV" pip install --quiet -p "$VENV/bin/python" --resolution "$RESOLUTION" -e ".[$EXTRAS]"
"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md

installed = {d.metadata["Name"].lower().replace("_", "-"): d.version for d in md.distributions()}
print("compat environment:", ", ".join(f"{p} {installed[p]}" for p in
      ("torch", "transformers", "tokenizers", "datasets", "safetensors", "pluggy", "huggingface-hub", "peft",
       "accelerate", "trl") if p in installed))
EOF
start=$(date +%s)
(cd "$(mktemp -d)" && "$OLDPWD/$VENV/bin/rlhf" train --train.progress false)
echo "default run: $(( $(date +%s) - start )) s"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/test_modeling.py tests/test_packing.py \
  tests/test_logits_chunks.py tests/test_algorithms.py "tests/test_algo_runs.py::test_every_estimator_runs" \
  tests/test_data_sources.py tests/test_sampling_knobs.py tests/test_mask_truncated.py tests/test_optimizers.py \
  "tests/test_train.py::test_default_run_learns" -k "not deepspeed"
if [ "$RESOLUTION" = highest ]; then
  "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/test_trl_peft.py tests/test_trl_rloo.py \
    tests/test_trl_losses.py tests/test_stages.py -k "not vllm and not ray and not sampling_corrections"
fi
