"""TRL's RLOOTrainer on this project's loop: ``RLOOTrainer`` (a script changes its import), ``RLOOConfig``'s
fields (``--trl-config FILE --trl-trainer rloo``, ``rlhf convert trl rloo``), and the algorithm TRL 1.16 runs
-- rewards clamped to ``reward_clip_range``, the KL to the reference (beta x the summed log-ratio, k1) taken
from each reward, the leave-one-out baseline, ``normalize_advantages``' whitening over the batch -- checked
against TRL's computation written out in float64 (the loss itself: tests/test_trl_losses.py)."""
from __future__ import annotations

import math

import pytest
import torch

from rlhf_plugins.errors import ConfigError
from rlhf_plugins.integrations.trl_config import from_trl_fields
from tests.helpers import check_one_line_error, in_process_trainer, metrics_of, samples_of, short_run, the_run


def trl_rloo_advantages(rewards, group: int, normalize: bool, clip=None, kl=None, beta: float = 0.0):
    """TRL 1.16's ``RLOOTrainer._generate_and_score_completions``: the weighted reward sum (None -- every
    function abstained -- as NaN) clamped to ``reward_clip_range``, minus ``beta`` x the completion's summed
    ``old - ref`` log-probs, minus the mean of the other scorable samples of its prompt; with
    ``normalize_advantages`` over the scorable samples' std (+ 1e-4); NaN advantages 0."""
    from trl.trainer.utils import nanstd

    rewards = torch.tensor([math.nan if r is None else r for r in rewards], dtype=torch.float64)
    if clip is not None:
        rewards = rewards.clamp(min=clip[0], max=clip[1])
    if kl is not None:
        rewards = rewards - beta * kl
    grouped = rewards.view(-1, group)
    counts = (~torch.isnan(grouped)).sum(1, keepdim=True)
    baselines = (torch.nansum(grouped, 1, keepdim=True) - grouped) / (counts - 1)
    advantages = rewards - baselines.reshape(-1)
    if normalize:
        advantages = (advantages - torch.nanmean(advantages)) / (nanstd(advantages) + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


def test_rloo_fields_map_to_trls_algorithm():
    """RLOOConfig's defaults (beta 0.05, two samples a prompt) and fields as ours; beta 0 leaves no reference."""
    raw, _ = from_trl_fields({"normalize_advantages": True, "reward_clip_range": (-1.0, 2.0), "epsilon_high": 0.28},
                             "rloo")
    algo = raw["algo"]
    assert {k: algo["policy_loss"][k] for k in ("name", "aggregation", "clip_low", "clip_high")} == \
        {"name": "sequence_ppo", "aggregation": "seq-mean-token-mean", "clip_low": 0.2, "clip_high": 0.28}
    assert algo["advantage"] == {"estimator": "rloo", "normalize_advantages": True}
    assert algo["kl"] == {"coef": 0.05, "in_reward": True, "estimator": "k1", "penalty_in_baseline": True}
    assert (raw["reward"]["clip_low"], raw["reward"]["clip"]) == (-1.0, 2.0)
    assert raw["generation"]["n_samples_per_prompt"] == 2
    raw, _ = from_trl_fields({"beta": 0.0}, "rloo")
    assert raw["algo"]["kl"] == {"coef": 0.0} and "normalize_advantages" not in raw["algo"]["advantage"]
    assert "clip" not in raw.get("reward", {})


@pytest.mark.parametrize("fields, trainer, message", [
    ({"loss_type": "dapo"}, "rloo", "'loss_type' is not a field of trl.RLOOConfig; it is a field of trl.GRPOConfig: "
                                    "run it with --trl-trainer grpo (rlhf convert trl grpo FILE, or GRPOTrainer from "
                                    "rlhf_plugins.integrations.trl)"),
    ({"normalize_advantages": True}, "grpo", "'normalize_advantages' is not a field of trl.GRPOConfig; it is a field "
                                             "of trl.RLOOConfig: run it with --trl-trainer rloo"),
    ({"reward_clip_range": (1.0, 0.5)}, "rloo", "TRL reward_clip_range (1, 0.5) has no equivalent here"),
    ({"reward_clip_range": "wide"}, "rloo", "TRL field 'reward_clip_range' expects two numbers (low, high)"),
])
def test_fields_of_the_other_trainer_and_bad_clip_ranges_are_one_error(fields, trainer, message):
    with pytest.raises(ConfigError) as err:
        from_trl_fields(fields, trainer)
    assert message in str(err.value)


def test_rloo_advantages_with_the_kl_in_the_reward_are_trls(tiny_model, tmp_path, monkeypatch):
    """A real rollout of the converted config, one update after the start (the policy has left the
    reference): the batch's advantages -- the same on every token of a completion -- are TRL's from the
    rollout's rewards, its clip range and the batch's rollout-time and reference log-probs."""
    from rlhf_plugins.training.rollout import make_batch

    monkeypatch.chdir(tmp_path)
    raw, _ = from_trl_fields({"num_generations": 4, "normalize_advantages": True, "reward_clip_range": (0.1, 0.8),
                              "per_device_train_batch_size": 32, "max_completion_length": 4, "learning_rate": 3e-3,
                              "beta": 0.5}, "rloo")
    t = in_process_trainer(tiny_model, raw)
    try:
        t.step(0)
        rollout, _ = t.collect(1)
        batch = make_batch(rollout, t.pad_id, **t.widths)
        t.forward_passes(batch)
        t.advantages(batch, rollout, t.kl_control.value)
    finally:
        t.shutdown()
    mask = batch["action_mask"].double()
    kl = ((batch["old_logprobs"].double() - batch["ref_logprobs"].double()) * mask).sum(-1)
    want = trl_rloo_advantages(rollout.raw_scores, 4, True, (0.1, 0.8), kl, 0.5)
    got = batch["advantages"].double()
    torch.testing.assert_close(got, want[:, None] * mask, rtol=1e-5, atol=1e-5)
    assert kl.abs().max() > 1e-3 and 0.1 in rollout.scores and 0.8 in rollout.scores  # the KL and both bounds acted
    without_kl = trl_rloo_advantages(rollout.raw_scores, 4, True, (0.1, 0.8))
    assert (want - without_kl).abs().max() > 1e-3


def _rewards(abstain: bool = False):
    """Two TRL reward functions; with ``abstain`` both say None on completions of three or more characters."""
    def correct(prompts, completions, label, **kwargs):
        return [None if abstain and len(c) >= 3 else 1.0 if c.strip() == str(want) else 0.0
                for c, want in zip(completions, label)]

    def brief(prompts, completions, **kwargs):
        return [None if abstain and len(c) >= 3 else 0.3 if len(c.strip()) <= 1 else -0.2 for c in completions]

    return [correct, brief]


def test_the_rloo_drop_in_runs_trls_algorithm_and_logs_trls_names(tiny_model, tmp_path, monkeypatch):
    """``RLOOTrainer`` with two weighted rewards, a clip range and normalize_advantages (beta 0: no
    reference): every logged sample's advantage is TRL's from its step's rewards, the step's share of
    clipped completions and the entropy are in log_history under TRL's names, and the weights moved."""
    from trl import RLOOConfig

    from rlhf_plugins.integrations.trl import RLOOTrainer

    monkeypatch.chdir(tmp_path)
    dataset = [{"prompt": f"{a}+{b}=", "label": str(a + b)} for a in range(10) for b in range(10)]
    args = RLOOConfig(output_dir="out", learning_rate=3e-3, num_generations=4, per_device_train_batch_size=16,
                      max_completion_length=4, max_steps=3, normalize_advantages=True, reward_weights=[1.0, 0.5],
                      reward_clip_range=(-0.05, 0.9), beta=0.0, use_cpu=True, bf16=False, report_to="none",
                      log_completions=True, logging_steps=1)
    trainer = RLOOTrainer(model=tiny_model, reward_funcs=_rewards(abstain=True), args=args, train_dataset=dataset)
    trainer.train()
    rows = samples_of(trainer.run_dir)
    assert sorted({r["step"] for r in rows}) == [0, 1, 2] and len(rows) == 3 * 16
    for step in range(3):
        mine = [r for r in rows if r["step"] == step]
        summed = [None if r["rewards"]["correct"] is None else r["rewards"]["correct"] + 0.5 * r["rewards"]["brief"]
                  for r in mine]
        want = trl_rloo_advantages(summed, 4, True, (-0.05, 0.9))
        assert [r["advantage"] for r in mine] == pytest.approx(want.tolist(), abs=1e-6), step
    assert any(r["reward"] > 0.9 or r["reward"] < -0.05 for r in rows)  # the clip bit
    unscored = [r for r in rows if r["rewards"]["correct"] is None]
    assert unscored and all(r["advantage"] == 0 for r in unscored)  # in no baseline, no advantage
    history = trainer.state.log_history
    assert [h["step"] for h in history] == [1, 2, 3]
    assert all(0 <= h["clip_ratio/region_mean"] <= 1 and h["entropy"] > 0 and "kl" not in h for h in history)
    before, after = _weights(tiny_model), _weights(trainer.run_dir / "final")
    assert max(float((after[k] - before[k]).abs().max()) for k in before) > 1e-4


def _weights(folder) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder)).state_dict()


def test_the_rloo_drop_in_refuses_another_trainers_config_and_a_quantized_model(tiny_model):
    from trl import GRPOConfig, RLOOConfig

    from rlhf_plugins.integrations.trl import GRPOTrainer, RLOOTrainer

    with pytest.raises(ConfigError, match="RLOOTrainer takes a trl.RLOOConfig as args; got GRPOConfig"):
        RLOOTrainer(model=tiny_model, reward_funcs=_rewards(), args=GRPOConfig(output_dir="out", report_to="none", use_cpu=True, bf16=False))
    with pytest.raises(ConfigError, match="GRPOTrainer takes a trl.GRPOConfig as args; got RLOOConfig"):
        GRPOTrainer(model=tiny_model, reward_funcs=_rewards(), args=RLOOConfig(output_dir="out", report_to="none", use_cpu=True, bf16=False))
    with pytest.raises(ConfigError, match=r"^quantization_config \(a bitsandbytes-quantized model, QLoRA\) has no "):
        RLOOTrainer(model=tiny_model, reward_funcs=_rewards(), quantization_config=object())


RLOO_YAML = """\
learning_rate: 0.001
num_generations: 4
per_device_train_batch_size: 16
max_completion_length: 6
normalize_advantages: true
reward_clip_range: [0.0, 0.9]
max_steps: 200
"""


def test_a_trl_rloo_yaml_trains_the_default_task_from_the_command_line(rlhf, tmp_path):
    """``rlhf train --trl-config rloo.yaml --trl-trainer rloo`` (the default task's model, prompts and reward):
    TRL's RLOO recipe, KL in the reward included, learns single-digit addition (seeds 0-3 gave +0.36 to +0.51,
    TRL's seed 42 +0.51, and +0.43 without vector kernels), clamps its rewards to the range and logs the KL it
    took from them."""
    path = tmp_path / "rloo.yaml"
    path.write_text(RLOO_YAML)
    code, _, err = rlhf("train", "--trl-config", str(path), "--trl-trainer", "rloo", "--train.progress", "false",
                        "--eval.enabled", "false")
    assert code == 0, err
    rows = metrics_of(the_run())
    assert len(rows) == 200 and all(math.isfinite(r["loss/total"]) for r in rows)
    tenth = len(rows) // 10
    first = sum(r["reward/mean"] for r in rows[:tenth]) / tenth
    last = sum(r["reward/mean"] for r in rows[-tenth:]) / tenth
    assert last - first > 0.25, (first, last)
    # k1 (the log-ratio) may be below 0 on a batch, unlike k3: that it moved is what is logged
    assert rows[0]["kl/rollout"] == 0 and max(abs(r["kl/rollout"]) for r in rows) > 0.01
    assert all(r["kl/coef"] == 0.05 for r in rows)
    clamped = [r for r in rows if r["reward/mean"] > 0]  # exact match scores 1, clamped to 0.9
    assert clamped and all(r["reward/shaped_mean"] == pytest.approx(0.9 * r["reward/mean"]) for r in clamped)


def test_rlhf_convert_trl_reads_trls_own_rloo_command_line(rlhf, tmp_path):
    """``rlhf convert trl -- trl rloo --config rloo.yaml`` writes what --trl-config with --trl-trainer rloo runs;
    the same file read as a GRPO config names the trainer it belongs to, and --trl-trainer alone is one line."""
    import yaml

    from rlhf_plugins.integrations.trl_config import from_trl_yaml

    path = tmp_path / "rloo.yaml"
    path.write_text(RLOO_YAML)
    out = tmp_path / "ours.yaml"
    code, _, err = rlhf("convert", "trl", "-o", str(out), "--", "trl", "rloo", "--config", str(path))
    assert code == 0, err
    text = out.read_text()
    assert text.startswith("# rlhf train --config this.yaml   (converted from the TRL RLOO config rloo.yaml")
    assert yaml.safe_load(text) == from_trl_yaml(path, "rloo")[0]
    assert yaml.safe_load(text)["algo"]["policy_loss"]["name"] == "sequence_ppo"
    # no dataset_name: the embedded task, rendered as rlhf train renders it (its prompts are written for it)
    assert "# note: no dataset_name: the embedded default task runs" in text
    assert "template_strings" not in yaml.safe_load(text).get("data", {})
    (tmp_path / "sums.jsonl").write_text('{"prompt": "1+2=", "label": "3"}\n')
    path.write_text(RLOO_YAML + f"dataset_name: {tmp_path / 'sums.jsonl'}\n")
    assert from_trl_yaml(path, "rloo")[0]["data"]["template_strings"] is False  # TRL's "standard" prompts
    code, _, err = rlhf("train", "--trl-config", str(path), *short_run())
    check_one_line_error(code, err, "'normalize_advantages' is not a field of trl.GRPOConfig; it is a field of "
                                    "trl.RLOOConfig: run it with --trl-trainer rloo")
    code, _, err = rlhf("train", "--trl-trainer", "rloo", *short_run())
    check_one_line_error(code, err, "--trl-trainer rloo says whose config --trl-config holds; give --trl-config FILE")


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rloo_leaves_samples_no_reward_scored_out_as_trl_does(seed, normalize):
    """Samples every reward function abstained on: in no sibling's baseline, advantage 0, out of the
    whitening; a group with one scored sample gives it 0 too (TRL's 0/0) -- against TRL's arithmetic on random
    groups, some with every sample scored (whose advantages are plain RLOO's)."""
    from rlhf_plugins.algorithms.advantages import AdvantageInputs, rloo

    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(24, generator=g, dtype=torch.float64)
    scored = torch.rand(24, generator=g) > 0.3
    scored[:4], scored[4:8] = True, torch.tensor([True, False, False, False])  # a whole group, a lone scored one
    mask = (torch.arange(6)[None, :] < torch.randint(1, 7, (24,), generator=g)[:, None]).double()
    rewards = [float(s) if k else None for s, k in zip(scores, scored)]
    want = trl_rloo_advantages(rewards, 4, normalize)
    got, _ = rloo(AdvantageInputs(torch.where(scored, scores, 0.0), mask, group_size=4, normalize=normalize,
                                  scored=scored))
    # TRL's nanstd takes its Bessel factor count / (count - 1) in float32: 1e-8 apart when whitened
    tol = 1e-7 if normalize else 1e-12
    torch.testing.assert_close(got, want[:, None] * mask, rtol=tol, atol=tol)
    assert (want[~scored] == 0).all() and want[4] == 0 and (want[scored][2:] != 0).any()
    plain, _ = rloo(AdvantageInputs(scores[:4], mask[:4], group_size=4))
    if not normalize:
        torch.testing.assert_close(got[:4], plain, rtol=1e-12, atol=1e-12)


def test_normalize_advantages_whitens_any_group_estimators_sequence_advantages():
    """On its own (--algo.advantage.normalize_advantages): group_norm's and dr_grpo's sequence advantages
    whitened over the batch by TRL's rule; the KL still to come is taken after the whitening."""
    from rlhf_plugins.algorithms.advantages import AdvantageInputs, dr_grpo, group_norm

    g = torch.Generator().manual_seed(0)
    scores = torch.rand(12, generator=g, dtype=torch.float64)
    mask = (torch.arange(5)[None, :] < torch.randint(1, 6, (12,), generator=g)[:, None]).double()
    for estimator, own in ((group_norm, lambda s: (s - s.mean(-1, keepdim=True)) / (s.std(-1, keepdim=True) + 1e-6)),
                           (dr_grpo, lambda s: s - s.mean(-1, keepdim=True))):
        plain = own(scores.view(-1, 4)).reshape(-1)
        want = (plain - plain.mean()) / (plain.std() + 1e-4)
        adv, _ = estimator(AdvantageInputs(scores, mask, group_size=4, normalize=True))
        torch.testing.assert_close(adv, want[:, None] * mask, rtol=1e-12, atol=1e-12)
        assert abs(float(want.std()) - 1) < 1e-3 and abs(float(plain.std()) - 1) > 0.05
    penalty = torch.full_like(mask, 0.01)
    adv, _ = group_norm(AdvantageInputs(scores, mask, group_size=4, normalize=True, kl_penalty=penalty))
    grouped = scores.view(-1, 4)
    plain = ((grouped - grouped.mean(-1, keepdim=True)) / (grouped.std(-1, keepdim=True) + 1e-6)).reshape(-1)
    whitened = (plain - plain.mean()) / (plain.std() + 1e-4)
    to_go = (penalty * mask).flip(-1).cumsum(-1).flip(-1) * mask
    torch.testing.assert_close(adv, whitened[:, None] * mask - to_go, rtol=1e-12, atol=1e-12)
