"""--reward.combine normalize_then_sum (GDPO; TRL's multi_objective_aggregation): each reward source's
scores normalised within each prompt group, then summed by weight -- against TRL 1.16's code written out
with TRL's own nanstd on random scores with abstentions, by hand on one group, in a run, and TRL's field."""
from __future__ import annotations

import json
import math
import random
import textwrap

import pytest
import torch

from rlhf_plugins.algorithms.shaping import normalize_then_sum
from tests.helpers import short_run


def trl_normalize_then_sum(parts: dict[str, list[float | None]], weights: list[float], g: int) -> list[float]:
    """TRL 1.16's GRPOTrainer, multi_objective_aggregation == "normalize_then_sum", up to the weighted
    sum (before its batch normalisation), None scores as NaN; a sample no function scored as 0."""
    from trl.trainer.utils import nanstd

    rewards_per_func = torch.tensor([[math.nan if v is None else v for v in col] for col in zip(*parts.values())],
                                    dtype=torch.float64)
    grouped = rewards_per_func.view(-1, g, len(parts))
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
    std_k = nanstd(grouped, dim=1, keepdim=True) if g > 1 else torch.zeros_like(mean_k)
    reward_k = ((grouped - mean_k) / (std_k + 1e-4)).view(-1, len(parts))
    rewards = (reward_k * torch.tensor(weights, dtype=torch.float64).unsqueeze(0)).nansum(dim=1)
    unscorable = rewards_per_func.isnan().all(dim=1)
    return torch.where(unscorable, torch.zeros_like(rewards), rewards).tolist()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_normalize_then_sum_is_trls(seed):
    rng = random.Random(seed)
    g, groups = 4, 5
    parts = {name: [None if rng.random() < 0.2 else rng.gauss(0, scale) for _ in range(g * groups)]
             for name, scale in (("correct", 1.0), ("format", 0.1), ("length", 30.0))}
    parts["correct"][:g] = [1.0] * g  # a group in which one function agrees everywhere: it adds 0 there
    weights = [1.0, 0.5, 2.0]
    ours = normalize_then_sum(parts, weights, g)
    # TRL's nanstd computes Bessel's correction count / (count - 1) in float32: agreement to about 1e-7 of each term
    assert ours == pytest.approx(trl_normalize_then_sum(parts, weights, g), rel=1e-6, abs=1e-6)
    assert len(ours) == g * groups


def test_one_group_by_hand():
    """Scores [1, 3] and [10, 10, ...]: the first normalises to -+1/(sqrt(2) + 1e-4), the second adds 0;
    a sample no source scored gets 0."""
    parts = {"a": [1.0, 3.0, None], "b": [10.0, 10.0, None]}
    got = normalize_then_sum(parts, [2.0, 1.0], 3)
    step = 2.0 * 1.0 / (math.sqrt(2) + 1e-4)
    assert got == pytest.approx([-step, step, 0.0], rel=1e-12)


def test_in_a_run_the_estimator_gets_the_gdpo_sum(rlhf, tmp_path):
    """Two reward functions of very different scales: the scores handed to the estimator are the GDPO
    sum of the components the rollout logged, not their weighted sum."""
    seen = tmp_path / "seen.jsonl"
    longish = tmp_path / "longish.py"
    longish.write_text("def longish(prompts, completions, **kwargs):\n    return [100.0 * len(c) for c in completions]\n")
    plugin = tmp_path / "gdpo_seen.py"
    plugin.write_text(textwrap.dedent(f"""
        import json
        from rlhf_plugins import hookimpl

        @hookimpl
        def rlhf_after_rollout(step, rollout):
            with open({str(seen)!r}, "a") as f:
                f.write(json.dumps({{"scores": rollout.scores, "parts": rollout.reward_components,
                                     "g": rollout.group_size}}) + "\\n")
    """))
    code, _, err = rlhf("train", "--plugin", str(longish), "--plugin", str(plugin), "--reward.functions", "exact_match,longish",
                        "--reward.weights", "1.0,0.5", "--reward.combine", "normalize_then_sum",
                        "--reward.stop_penalty", "0", *short_run("--train.steps", "2"))
    assert code == 0, err
    rows = [json.loads(line) for line in seen.read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:
        expected = trl_normalize_then_sum(row["parts"], [1.0, 0.5], row["g"])
        assert row["scores"] == pytest.approx(expected, rel=1e-6, abs=1e-9)
        weighted = [a + 0.5 * b for a, b in zip(row["parts"]["exact_match"], row["parts"]["longish"])]
        assert row["scores"] != pytest.approx(weighted)


def test_trls_field_maps_to_the_combination():
    from rlhf_plugins.integrations.trl_config import from_grpo_fields

    raw, notes = from_grpo_fields({"multi_objective_aggregation": "normalize_then_sum", "scale_rewards": "group"})
    assert raw["reward"]["combine"] == "normalize_then_sum"
    assert raw["algo"]["advantage"]["estimator"] == "group_mean_batch_std"
    assert any("GDPO" in n for n in notes)
    raw, _ = from_grpo_fields({})
    assert "combine" not in raw.get("reward", {}) and raw["algo"]["advantage"]["estimator"] == "group_norm"
