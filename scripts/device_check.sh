#!/usr/bin/env bash
# The prepared check for a lent GPU machine (run through the device tool from the repository root):
# installs the carried wheelhouse (scripts/gpu_wheelhouse.sh, carried as .whl), prints versions and
# nvidia-smi, runs the GPU tests (tests/gpu, marker gpu), bench/gpu.py (and with DEVICE_CHECK_HEAD=1 bench/head.py,
# measured in runs 4-7), and writes
# device_check.log, gpu_tests.xml and gpu_graph_tests.xml, head.json, gpu_bench.json and device_check.json
# under $OUT. 251-287 s
# on an H200 (2026-11-25, tests and two bench sides); 344 s on an H100 (2026-11-26, run 4: tests,
# bench/head.py and four bench sides); run 6 (2026-11-27, H100): the tests alone 183 s; run 7 (2026-12-04, H200):
# the tests 254 s, then 153 s left for the first bench side (bench/gpu.py prints a line per step). The whole check
# keeps to DEVICE_CHECK_SECONDS (default 500; 480 with a device call limit of 520 s leaves a lent
# session's 15 minutes room for a second, shorter call): the bench's sides run in the order given,
# ours-graphs-layers-16384 (CUDA graphs, new since run 6), ours-compile-16384 (run 6's best), ours,
# trl (BENCH_SIDES to choose; bench/gpu.py --help lists the others) and the JSON is written after
# each, so a short deadline drops the last sides first.
# DEVICE_CHECK_TESTS=0 runs the benchmarks alone (about 90 s a side once compiled; the graph side longer).
# Without CUDA (checking it here) the tests are skipped and the benchmarks are not run.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/rlhf-device-check}"
mkdir -p "$OUT"
exec > >(tee "$OUT/device_check.log") 2>&1
PY="${PYTHON:-python3}"
start=$(date +%s)
if "$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' && compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --upgrade --no-index --no-deps --no-compile --no-cache-dir --target /tmp/rlhf-site .whl/*.whl || exit 3
    export PYTHONPATH="$PWD:/tmp/rlhf-site"
else
    echo "wheelhouse not installed (it is built for CPython 3.12; this is $("$PY" -V 2>&1)): using this environment"
    export PYTHONPATH="$PWD"
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false RLHF_DISABLE_PLUGIN_AUTOLOAD=1 \
       RLHF_CACHE_DIR=/tmp/rlhf-cache PYTHONUNBUFFERED=1
nvidia-smi || echo "nvidia-smi: not available"
"$PY" - <<'PYEOF'
import importlib.metadata as m, sys
import torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
for name in ("transformers", "peft", "accelerate", "deepspeed", "trl", "datasets", "rlhf-plugins"):
    try:
        print(f"  {name} {m.version(name)}")
    except m.PackageNotFoundError:
        print(f"  {name} missing")
PYEOF
# one deadline for the whole check (the device tool's call limit is set above it): the tests get at
# most 420 s (150 s each, so one hang cannot take the rest; run 7's took 254 s with the graph test failing early),
# in two stages with a JUnit XML each -- the CUDA-graph tests of compiled layers (compiling and recording
# whole layers: the slowest) after the others, so a stage its cap kills loses only its own XML -- and the
# benchmark what is left but 20 s when that is 150 s or more
DEADLINE=$(( start + ${DEVICE_CHECK_SECONDS:-500} ))
GRAPHS="replayed_as_cuda_graphs"
# DEVICE_CHECK_TESTS=0 leaves the tests out: a second call of a session measures more benchmark sides
if [ "${DEVICE_CHECK_TESTS:-1}" = 0 ]; then
    echo "tests/gpu: not run (DEVICE_CHECK_TESTS=0)"
    tests=-1
else
    tests_start=$(date +%s)
    timeout 300 "$PY" -m pytest -q -m gpu tests/gpu -k "not $GRAPHS" -rA --timeout 150 --junitxml "$OUT/gpu_tests.xml" \
        -p no:cacheprovider -p no:logging
    tests=$?
    cap=$(( 420 - ($(date +%s) - tests_start) ))
    timeout "$cap" "$PY" -m pytest -q -m gpu tests/gpu -k "$GRAPHS" -rA --timeout 150 \
        --junitxml "$OUT/gpu_graph_tests.xml" -p no:cacheprovider -p no:logging
    graphs=$?
    [ "$tests" = 0 ] && tests=$graphs
fi
bench=skipped
if "$PY" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())'; then
    # the fused head against autograd + checkpoint at the benchmark's 64 x 256 completion tokens (seconds)
    if [ "${DEVICE_CHECK_HEAD:-0}" = 1 ]; then
        timeout 90 "$PY" bench/head.py --device cuda --tokens 16384 --json "$OUT/head.json" || echo "bench/head.py failed ($?)"
    fi
    left=$(( DEADLINE - $(date +%s) - 20 ))
    echo "bench/gpu.py: $left s left"
    if [ "$left" -lt 150 ]; then
        bench="not run (only $left s left before DEVICE_CHECK_SECONDS; DEVICE_CHECK_TESTS=0 runs it alone)"
    else
        timeout "$left" "$PY" bench/gpu.py --steps "${BENCH_STEPS:-4}" --sides "${BENCH_SIDES:-ours-graphs-layers-16384,ours-compile-16384,ours,trl}" --json "$OUT/gpu_bench.json" && bench=ok \
            || bench="failed ($?)"
    fi
else
    echo "no CUDA here: bench/gpu.py not run"
fi
"$PY" - "$OUT" "$tests" "$bench" <<'PYEOF'
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path
out, tests, bench = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
cases = []
for xml in (out / "gpu_tests.xml", out / "gpu_graph_tests.xml"):
    if not xml.is_file():
        continue
    for case in ET.parse(xml).iter("testcase"):
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome = f"{tag}: {(found.get('message') or '')[:300]}"
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        cases.append({"test": case.get("name"), "seconds": float(case.get("time", 0)), "outcome": outcome, **props})
report = {"pytest_exit": tests if tests >= 0 else "not run", "bench": bench, "tests": cases}
if (out / "head.json").is_file():
    report["head"] = json.loads((out / "head.json").read_text())
if (out / "gpu_bench.json").is_file():
    report["gpu_bench"] = json.loads((out / "gpu_bench.json").read_text())["results"]
(out / "device_check.json").write_text(json.dumps(report, indent=2))
print(json.dumps({k: v for k, v in report.items() if k != "tests"}, indent=1)[:3000])
PYEOF
echo "device check finished in $(( $(date +%s) - start )) s"
