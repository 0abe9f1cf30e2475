"""Every algorithm option in a real (short) run on the embedded default."""
from __future__ import annotations

import json
import math
import re
import textwrap
from pathlib import Path

import pytest

from tests.helpers import ROOT, metrics_of, short_run, the_run


@pytest.mark.parametrize("estimator", ["group_norm", "dr_grpo", "rloo", "group_mean_batch_std", "reinforce",
                                       "reinforce_baseline", "gae", "batch_mean"])
def test_every_estimator_runs(rlhf, estimator):
    code, _, err = rlhf("train", "--algo.advantage.estimator", estimator, *short_run())
    assert code == 0, err
    rows = metrics_of(the_run())
    assert len(rows) == 3 and all(math.isfinite(r["loss/total"]) for r in rows)
    assert ("critic/loss" in rows[0]) == (estimator == "gae")
    if estimator == "gae":  # the critic trains: its value head starts at zero and moves with each update
        values = [r["critic/values"] for r in rows]
        assert values[0] == 0.0 and values[1] != 0.0 and values[2] != values[1], values


def test_the_flash_reinforce_recipe_trains_with_one_sample_per_prompt(rlhf):
    """docs/algorithms.md's FlashREINFORCE line: the batch's baseline, the binary-KL sequence trust region (the
    transformers engine holds the learner's weights: every trajectory admitted, ratio 1), sample-mean
    aggregation, no reference; the policy moves on every step whose rewards differ."""
    code, _, err = rlhf("train", "--generation.n_samples_per_prompt", "1", "--algo.advantage.estimator", "batch_mean",
                        "--algo.kl.coef", "0", "--algo.policy_loss.mismatch", "seq_icepop",
                        "--algo.policy_loss.mismatch_gate", "binary_kl", "--algo.policy_loss.aggregation",
                        "seq-mean-token-mean", *short_run())
    assert code == 0, err
    rows = metrics_of(the_run())
    assert all(r["mismatch/dropped_frac"] == 0.0 and r["mismatch/ratio_mean"] == pytest.approx(1.0, abs=1e-3)
               and "kl" not in r for r in rows)  # all admitted, no KL term
    # the mismatch as TRL logs it (sampling/*): the learner recomputes the engine's log-probs, all admitted
    assert all(0 <= r["mismatch/abs_log_ratio"] <= r["mismatch/abs_log_ratio_max"] < 1e-3 and
               r["mismatch/weight_min"] <= r["mismatch/weight_mean"] <= r["mismatch/weight_max"] for r in rows)
    spread = [r for r in rows if r["reward/std"] > 0]
    assert spread and all(r["grad_norm"] > 0 and r["advantage/std"] > 0 for r in spread)


def test_reinforce_with_one_sample_per_prompt(rlhf, tiny_model):
    """REINFORCE++ needs no groups: with one sample per prompt it still moves the policy."""
    from transformers import AutoModelForCausalLM

    code, _, err = rlhf("train", "--algo.advantage.estimator", "reinforce", *short_run("--generation.n_samples_per_prompt", "1"))
    assert code == 0, err
    rows = metrics_of(the_run())
    assert all(math.isfinite(r["loss/total"]) for r in rows)
    # REINFORCE++ normalises over the batch: a step whose samples all scored the same has nothing to learn
    spread = [r for r in rows if r["reward/std"] > 0]
    assert spread and all(r["grad_norm"] > 0 for r in spread)
    before = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    after = AutoModelForCausalLM.from_pretrained(the_run() / "final").state_dict()
    moved = max(float((after[k] - before[k]).abs().max()) for k in before)
    assert moved > 1e-4  # three AdamW steps at lr 1e-3 move weights by about 1e-3


@pytest.mark.slow
def test_ppo_with_a_critic_learns_and_the_critic_reloads(rlhf):
    code, _, err = rlhf("train", "--algo.advantage.estimator", "gae", "--train.steps", "100", "--train.progress", "false",
                        "--train.run_name", "ppo")
    assert code == 0, err
    summary = json.loads(Path("runs/ppo/summary.json").read_text())
    assert summary["reward_last_10pct"] - summary["reward_first_10pct"] >= 0.25, summary
    critic = Path("runs/ppo/critic")
    assert (critic / "value_head.safetensors").is_file()
    rows = metrics_of(Path("runs/ppo"))
    assert rows[-1]["critic/values"] != 0.0  # the value head left zero
    code, _, err = rlhf("train", "--algo.advantage.estimator", "gae", "--critic.path", str(critic),
                        *short_run("--train.run_name", "again"))
    assert code == 0, err
    first = metrics_of(Path("runs/again"))[0]
    assert abs(first["critic/values"]) > 1e-4  # loaded, not a fresh zero head


def test_the_critic_takes_its_own_schedule_and_logs_its_lr_and_grad_norm_beside_the_actors(rlhf):
    """critic.lr_scheduler / warmup_ratio / min_lr_ratio schedule the critic alone; the step's ``lr`` and
    ``grad_norm`` stay the actor's (the critic's were written over them), the critic's are ``critic/*``."""
    code, _, err = rlhf("train", "--algo.advantage.estimator", "gae", "--learner.lr", "1e-4", "--critic.lr", "2e-3",
                        "--critic.lr_scheduler", "linear", "--critic.warmup_ratio", "0.25", "--critic.min_lr_ratio", "0",
                        *short_run("--train.steps", "4"))
    assert code == 0, err
    rows = metrics_of(the_run())
    assert [r["lr"] for r in rows] == [1e-4] * 4  # the actor's constant schedule
    # 4 updates, 1 of warm-up, then linear to 0 over the other 3; each row holds the lr the next update takes
    assert [r["critic/lr"] for r in rows] == pytest.approx([2e-3, 2e-3 * 2 / 3, 2e-3 / 3, 0.0])
    assert all(r["grad_norm"] > 0 and r["critic/grad_norm"] > 0 and r["grad_norm"] != r["critic/grad_norm"]
               for r in rows)


def test_the_critics_optimizer_takes_its_own_settings_and_the_actors_stay(tiny_model):
    """critic.optimizer / betas / eps / weight_decay / max_grad_norm / warmup_ratio reach the critic's torch
    optimizer, DeepSpeed config and memory plan; the actor keeps learner.*."""
    from rlhf_plugins.api import prepare
    from rlhf_plugins.learners.deepspeed_config import deepspeed_config
    from rlhf_plugins.learners.torch_learner import TorchLearner
    from rlhf_plugins.models.memory import ADAM_STATES, MemoryInputs, ModelShape, optimizer_states
    from rlhf_plugins.testing import backend_context

    config, pm, _ = prepare({"algo": {"advantage": {"estimator": "gae"}},
                             "learner": {"betas": [0.8, 0.9], "eps": 1e-6, "weight_decay": 0.1, "max_grad_norm": 2.0,
                                         "warmup_steps": 3},
                             "critic": {"optimizer": "adam", "betas": [0.5, 0.6], "eps": 1e-3, "weight_decay": 0.25,
                                        "max_grad_norm": 0.5, "warmup_ratio": 0.5}},
                            autoload=False)
    seen = {}
    for role in ("actor", "critic"):
        learner = TorchLearner(backend_context(config, role, tiny_model, pm))
        decayed = next(g for g in learner.optimizer.param_groups if g["weight_decay"] > 0)
        seen[role] = (type(learner.optimizer).__name__, decayed["betas"], decayed["eps"], decayed["weight_decay"],
                      learner.cfg.max_grad_norm, deepspeed_config(config, role, 1)["gradient_clipping"],
                      learner.cfg.warmup_steps, learner.cfg.warmup_ratio)
    # the critic's warm-up ratio replaces the learner's warm-up steps, which would otherwise come first
    assert seen == {"actor": ("AdamW", (0.8, 0.9), 1e-6, 0.1, 2.0, 2.0, 3, 0.0),
                    "critic": ("Adam", (0.5, 0.6), 1e-3, 0.25, 0.5, 0.5, 0, 0.5)}
    # the memory plan counts each role's optimizer states: a critic on momentum-free SGD keeps none
    sgd, _, _ = prepare({"algo": {"advantage": {"estimator": "gae"}}, "critic": {"optimizer": "sgd"}}, autoload=False)
    shape = ModelShape.of_folder(tiny_model)
    states = {role: optimizer_states(MemoryInputs(sgd, shape, role, 1, shape.parameters, 0, 0))
              for role in ("actor", "critic")}
    assert states == {"actor": ADAM_STATES * shape.parameters, "critic": 0}


def test_kl_in_reward_with_adaptive_controller(rlhf):
    code, _, err = rlhf("train", "--algo.advantage.estimator", "reinforce", "--algo.kl.in_reward", "true",
                        "--algo.kl.controller", "adaptive", "--algo.kl.coef", "0.05", "--algo.kl.target", "0.001",
                        "--algo.kl.horizon", "100", *short_run("--train.steps", "4"))
    assert code == 0, err
    rows = metrics_of(the_run())
    coefs = [r["kl/coef"] for r in rows]
    assert coefs[0] == 0.05 and coefs[-1] != coefs[0]
    assert all("kl/rollout" in r for r in rows)
    # KL is in the reward, so the loss has no KL term
    assert all(r["loss/total"] == pytest.approx(r["loss/policy"], abs=1e-7) for r in rows)


@pytest.mark.parametrize("mode", ["tis", "icepop", "seq_mask_tis", "seq_icepop binary_kl", "engine_ratio"])
def test_mismatch_correction_runs_and_sees_matching_policies(rlhf, mode):
    mode, *gate = mode.split()
    gating = ["--algo.policy_loss.mismatch_gate", *gate] if gate else []
    code, _, err = rlhf("train", "--algo.policy_loss.mismatch", mode, *gating, *short_run())
    assert code == 0, err
    for row in metrics_of(the_run()):
        # the transformers engine holds the learner's exact weights: ratios are ~1, nothing dropped
        if mode == "engine_ratio":  # no weights: the policy's own ratio, against the engine's log-probs
            assert row["loss/ratio_mean"] == pytest.approx(1.0, abs=1e-3)
            assert row["mismatch/abs_log_ratio"] < 1e-4 and "mismatch/dropped_frac" not in row
            continue
        assert row["mismatch/ratio_mean"] == pytest.approx(1.0, abs=1e-3)
        assert row["mismatch/dropped_frac"] == 0.0


def test_gspo_dual_clip_entropy_and_aggregation(rlhf):
    code, _, err = rlhf("train", "--algo.policy_loss.name", "gspo", "--algo.policy_loss.clip_low", "0.0003",
                        "--algo.policy_loss.clip_high", "0.0004", "--algo.policy_loss.aggregation", "seq-mean-token-mean",
                        "--algo.policy_loss.entropy_coef", "0.01", "--learner.epochs", "2", *short_run())
    assert code == 0, err
    rows = metrics_of(the_run())
    assert all("entropy" in r for r in rows) and any(r["loss/clip_frac"] > 0 for r in rows)
    code, _, err = rlhf("train", "--algo.policy_loss.dual_clip", "3", "--algo.policy_loss.aggregation",
                        "seq-mean-token-sum-norm", "--algo.advantage.estimator", "dr_grpo",
                        "--learner.mini_batch_size", "8", "--learner.micro_batch_size", "4",
                        *short_run("--train.run_name", "dual"))
    assert code == 0, err
    assert "loss/dual_clip_frac" in metrics_of(Path("runs/dual"))[0]


def test_reward_shaping_and_weighted_functions_logged_separately(rlhf, tmp_path):
    extra = tmp_path / "extra.py"
    extra.write_text("def shortness(prompts, completions, **kwargs):\n    return [-len(c) / 10 for c in completions]\n")
    code, _, err = rlhf("train", "--plugin", str(extra), "--reward.functions", "exact_match,shortness",
                        "--reward.weights", "1.0,0.5", "--reward.normalize", "true", "--reward.clip", "2",
                        "--reward.stop_penalty", "0.5", "--reward.overlong_buffer", "2", *short_run())
    assert code == 0, err
    rows = metrics_of(the_run())
    assert {"reward/exact_match", "reward/shortness", "reward/shaped_mean"} <= set(rows[0])
    assert all(-2.0 <= r["reward/shaped_mean"] <= 2.0 for r in rows)


def test_dynamic_filtering_trains_only_on_groups_with_signal(rlhf, tmp_path):
    checker = tmp_path / "groups.py"
    checker.write_text(textwrap.dedent(f"""
        from rlhf_plugins import hookimpl
        @hookimpl
        def rlhf_after_rollout(step, rollout):
            g = rollout.group_size
            for i in range(0, len(rollout), g):
                block = rollout.scores[i:i + g]
                assert max(block) > min(block), block
            open({str(tmp_path / "sizes.txt")!r}, "a").write(f"{{len(rollout) // g}}\\n")
    """))
    code, _, err = rlhf("train", "--plugin", str(checker), "--reward.dynamic_filtering", "true",
                        "--reward.functions", "exact_match", *short_run("--train.steps", "4"))
    assert code == 0, err
    assert "failed in rlhf_after_rollout" not in err  # the observer's assertion held
    sizes = [int(x) for x in (tmp_path / "sizes.txt").read_text().split()]
    rows = metrics_of(the_run())
    assert all(0 < s <= 4 for s in sizes)
    assert all(r["filter/rounds"] >= 1 and 0 < r["filter/kept_groups"] <= 1 for r in rows)


def test_dynamic_filtering_compares_an_openrlhf_reward_files_scores_and_trains_on_its_rewards(rlhf, tmp_path):
    """OpenRLHF's reward_func returns ``rewards`` (trained on) and ``scores`` (what --dynamic_filtering
    compares, against --dynamic_filtering_reward_range). Scores 0 / 1 and rewards 5 / 6: the groups kept
    are the ones whose scores are mixed -- comparing the rewards, no mean is inside (0, 1)."""
    reward = tmp_path / "reward_func.py"
    reward.write_text(textwrap.dedent("""
        import torch
        def reward_func(queries, prompts, labels):
            scores = torch.tensor([float(len(q) % 2) for q in queries])
            return {"rewards": scores + 5.0, "scores": scores, "extra_logs": {}}
    """))
    checker = tmp_path / "groups.py"
    checker.write_text(textwrap.dedent(f"""
        import json
        from rlhf_plugins import hookimpl
        @hookimpl
        def rlhf_after_rollout(step, rollout):
            g = rollout.group_size
            blocks = [rollout.raw_scores[i:i + g] for i in range(0, len(rollout), g)]
            open({str(tmp_path / "kept.txt")!r}, "a").write(json.dumps(blocks) + "\\n")
    """))
    code, _, err = rlhf("train", "--plugin", str(reward), "--plugin", str(checker), "--reward.dynamic_filtering",
                        "true", "--reward.filter_range", "0,1", *short_run("--train.steps", "3"))
    assert code == 0, err
    rows = metrics_of(the_run())
    assert all(r["filter/kept_groups"] > 0 for r in rows), rows
    assert all(5.0 <= r["reward/mean"] <= 6.0 for r in rows)  # the rewards trained
    kept = [json.loads(line) for line in (tmp_path / "kept.txt").read_text().splitlines()]
    assert len(kept) == 3
    assert all(set(block) == {5.0, 6.0} for blocks in kept for block in blocks), kept  # mixed scores only


def test_readme_third_party_estimator_is_picked_by_name(rlhf, tmp_path):
    """The README's estimator plugin (at most 15 lines), run as written."""
    readme = (ROOT / "README.md").read_text()
    code_block = re.search(r"```python\n(from rlhf_plugins import AdvantageEstimator.*?)```", readme, re.S).group(1)
    assert len(code_block.strip().splitlines()) <= 15
    plugin = tmp_path / "median_plugin.py"
    plugin.write_text(code_block)
    code, _, err = rlhf("train", "--plugin", str(plugin), "--algo.advantage.estimator", "median", *short_run())
    assert code == 0, err
    import yaml

    assert yaml.safe_load((the_run() / "config.yaml").read_text())["algo"]["advantage"]["estimator"] == "median"


def test_the_actor_waits_while_the_critic_warms_up(rlhf):
    """OpenRLHF's --freezing_actor_steps: the first steps train the critic alone; KL in the reward
    measures the actor against the reference, which it still is until its first update."""
    code, _, err = rlhf("train", "--algo.advantage.estimator", "gae", "--critic.freezing_steps", "2",
                        "--algo.kl.in_reward", "true", "--algo.kl.coef", "0.05",
                        *short_run("--train.steps", "4", "--train.run_name", "warm"))
    assert code == 0, err
    rows = metrics_of(Path("runs/warm"))
    assert ["loss/policy" in r for r in rows] == [False, False, True, True]
    assert all("critic/loss" in r for r in rows), rows[0].keys()
    kl = [r["kl/rollout"] for r in rows]
    assert kl[:3] == [0.0, 0.0, 0.0] and kl[3] > 0  # steps 0-2 sampled the reference's very weights


def test_freezing_the_actor_without_a_critic_is_one_line(rlhf):
    code, _, err = rlhf("train", "--critic.freezing_steps", "2", *short_run())
    assert code == 2
    assert err.strip() == ("rlhf: error: critic.freezing_steps trains the critic alone for a while, but this run has "
                           "no critic (estimator 'group_norm'); drop it or use --algo.advantage.estimator gae")


def test_a_run_trains_only_its_highest_entropy_tokens(rlhf):
    code, _, err = rlhf("train", "--algo.policy_loss.top_entropy_quantile", "0.25",
                        *short_run("--train.steps", "2", "--train.run_name", "forks"))
    assert code == 0, err
    kept = [r["loss/entropy_kept_frac"] for r in metrics_of(Path("runs/forks"))]
    assert len(kept) == 2 and all(0.15 < k < 0.45 for k in kept), kept  # about a quarter of each micro batch


def test_advantages_whitened_over_the_batch_or_centred_alone(rlhf):
    """REINFORCE++-baseline whitens its advantages over the batch (std 1 per step); with
    ``--algo.advantage.std_norm false`` (OpenRLHF's --no_advantage_std_norm) it subtracts the batch mean
    alone, so the advantages keep the spread of the scores (here within [-1, 1])."""
    stds = {}
    for norm in ("true", "false"):
        code, _, err = rlhf("train", "--algo.advantage.estimator", "reinforce_baseline", "--algo.advantage.std_norm",
                            norm, *short_run("--train.run_name", f"norm-{norm}"))
        assert code == 0, err
        rows = metrics_of(Path("runs") / f"norm-{norm}")
        assert all(abs(r["advantage/mean"]) < 1e-5 for r in rows), rows
        stds[norm] = [r["advantage/std"] for r in rows if r["reward/std"] > 0]
    assert stds["true"] and all(abs(s - 1) < 0.02 for s in stds["true"]), stds
    assert stds["false"] and all(0 < s < 0.9 for s in stds["false"]), stds
