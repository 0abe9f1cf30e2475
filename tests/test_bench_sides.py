"""The GPU benchmark's sides are checked here, before any device time is spent on them: every side
the device check runs by default exists in bench/gpu.py, and every variant's learner settings are a
config the CLI accepts (a misspelt setting would otherwise cost a lent GPU's only run)."""
from __future__ import annotations

import ast
import re

import pytest

from tests.helpers import ROOT


def _variants() -> dict[str, tuple[str, dict]]:
    tree = ast.parse((ROOT / "bench" / "gpu.py").read_text())
    found = [node.value for node in tree.body if isinstance(node, ast.Assign)
             and any(isinstance(t, ast.Name) and t.id == "VARIANTS" for t in node.targets)]
    assert len(found) == 1, "bench/gpu.py defines VARIANTS once, as a literal"
    return ast.literal_eval(found[0])


def test_the_device_checks_default_sides_exist_in_the_benchmark():
    script = (ROOT / "scripts" / "device_check.sh").read_text()
    defaults = re.findall(r"\$\{BENCH_SIDES:-([a-z0-9,\-]+)\}", script)
    assert len(defaults) == 1, defaults
    sides = defaults[0].split(",")
    assert {"ours", "trl"} <= set(sides), sides  # the ratio to TRL needs both
    assert set(sides) - {"ours", "trl"} <= set(_variants()) and len(set(sides)) == len(sides), sides


@pytest.mark.parametrize("side", sorted(_variants()))
def test_every_benchmark_variant_is_a_config_the_cli_accepts(side):
    from rlhf_plugins.api import prepare

    what, learner = _variants()[side]
    assert what and learner
    config, _, _ = prepare({"model": {"dtype": "bfloat16"}, "learner": dict(learner)}, autoload=False)
    assert all(getattr(config.learner, key) == value for key, value in learner.items())


def _bench_module(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_training_flops_count_each_prompt_once_per_group_as_the_update_runs_it():
    flops = _bench_module("_trl").training_flops
    # by hand: decoder 10, head 3, 2 prompts x 4 samples, prompts of 5 tokens, completions of 7
    # head: 6 x 3 x 8 samples x 7 = 1008; decoder shared: 6 x 10 x (2 x 5 + 8 x 7) = 3960;
    # decoder plain: 6 x 10 x 8 x (5 + 7) = 5760
    assert flops(10, 3, 2, 4, 5, 7) == {"shared": 3960 + 1008, "plain": 5760 + 1008}
    one = flops(10, 3, 8, 1, 5, 7)  # groups of one sample share nothing
    assert one["shared"] == one["plain"] == 6 * 10 * 8 * 12 + 6 * 3 * 8 * 7
