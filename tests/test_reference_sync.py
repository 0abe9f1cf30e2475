"""The reference model: a folder of its own (--model.reference_path, OpenRLHF's --ref_pretrain) -- what
scores the rollout, in process and on Ray, and the refusals -- and moving towards the policy
(--algo.kl.ref_sync_steps, TRL's sync_ref_model): the mixing rule on random tensors, when it happens in a
run and what the reference then holds, its effect on the KL, exact resume across a move, TRL's fields, the
refusals, and the Ray path."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from rlhf_plugins.training.runlog import MEASURED
from tests.helpers import (
    check_one_line_error,
    eval_rows_of,
    in_process_trainer,
    metrics_of,
    random_llama,
    short_run,
    the_run,
)


def _reference_weights(ctx):
    return {name: t.detach().clone() for name, t in ctx.backend.state_dict().items()}


def _policy_weights(ctx):
    return {name: t.detach().clone() for name, t in ctx.backend.named_weights()}


@pytest.fixture(scope="module")
def other_reference(tiny_model, tmp_path_factory):
    """The tiny model with every weight moved by noise, saved with its tokenizer: a reference of its own."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf_plugins.models.folder import save_pretrained, save_tokenizer

    folder = tmp_path_factory.mktemp("reference")
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    save_pretrained(model, folder)
    save_tokenizer(AutoTokenizer.from_pretrained(tiny_model), folder)
    return str(folder)


def _saved_weights(folder):
    from safetensors.torch import load_file

    return load_file(str(Path(folder) / "model.safetensors"))


def test_a_reference_of_its_own_scores_the_rollout_and_the_kl_is_taken_to_it(tiny_model, other_reference, tmp_path,
                                                                              monkeypatch):
    """--model.reference_path: the reference role holds that folder's weights (the policy its own), the
    rollout's reference log-probs are that model's forward, not the policy's, and the KL measured before
    the first update -- zero when the reference is the initial policy -- is the distance to it."""
    from transformers import AutoModelForCausalLM

    from rlhf_plugins.models.forward import policy_forward
    from rlhf_plugins.training.rollout import make_batch

    monkeypatch.chdir(tmp_path)
    raw = {"train": {"prompts_per_step": 4, "steps": 1}, "generation": {"n_samples_per_prompt": 4},
           "algo": {"kl": {"coef": 0.05}}}
    t = in_process_trainer(tiny_model, {**raw, "model": {"reference_path": other_reference}})
    try:
        held = t.reference.run(_reference_weights, rank=0)
        rollout, _ = t.collect(0)
        batch = make_batch(rollout, t.pad_id, **t.widths)
        t.forward_passes(batch)
        kl = t.learn(0, rollout, {}, 0.0, sync=False)["kl"]
    finally:
        t.shutdown()
    saved = _saved_weights(other_reference)
    assert set(saved) <= set(held) and all(torch.equal(held[k], v) for k, v in saved.items())
    mask = batch["action_mask"].bool()
    for folder, same in ((other_reference, True), (tiny_model, False)):
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        with torch.no_grad():
            want = policy_forward(model, batch, temperature=t.config.generation.temperature)["logprobs"]
        gap = (batch["ref_logprobs"][mask] - want[mask]).abs().max().item()
        assert gap < 1e-5 if same else gap > 1e-2, (folder, gap)
    assert kl > 1e-3
    t = in_process_trainer(tiny_model, raw)
    try:
        assert abs(t.step(0)["kl"]) < 1e-6  # the initial policy as reference: nothing yet between them
    finally:
        t.shutdown()


def test_a_reference_of_its_own_that_is_unused_or_unfit_is_one_line_and_one_that_fits_is_sized_as_it_is(
        rlhf, other_reference, tmp_path):
    """Unused (KL off) it is refused; it must score every token of the policy's tokenizer; mixed with the policy
    (ref_sync_steps) it must have the policy's shape: one of the same shape is accepted, a wider one refused. A
    wider one where nothing mixes into it runs, and the memory plan counts its own weights."""
    code, _, err = rlhf("train", "--model.reference_path", other_reference, "--algo.kl.coef", "0", "--dry-run")
    check_one_line_error(code, err, f"model.reference_path '{other_reference}' is the KL's reference model, and "
                                    "algo.kl.coef 0 runs without one; set --algo.kl.coef above 0 or drop "
                                    "--model.reference_path")
    small = random_llama(tmp_path / "small", vocab_size=100)
    code, _, err = rlhf("train", "--model.reference_path", small, "--dry-run")
    check_one_line_error(code, err, f"model.reference_path '{small}' has a vocabulary of 100 tokens and the policy's "
                                    "tokenizer 366; the reference scores the policy's tokens")
    code, _, err = rlhf("train", "--model.reference_path", other_reference, "--algo.kl.ref_sync_steps", "2", "--dry-run")
    assert code == 0, err
    wider = random_llama(tmp_path / "wider", hidden_size=384, intermediate_size=1024)
    code, _, err = rlhf("train", "--model.reference_path", wider, "--algo.kl.ref_sync_steps", "2", "--dry-run")
    check_one_line_error(code, err, "algo.kl.ref_sync_steps mixes the policy's weights into the reference model, and "
                                    f"model.reference_path '{wider}' has another shape than the policy; drop one of "
                                    "them")
    code, out, err = rlhf("train", "--model.reference_path", wider, "--dry-run")
    assert code == 0, err  # a reference of another size is fine where nothing mixes into it
    code, plain, err = rlhf("train", "--dry-run")
    assert code == 0, err

    def reference_weights_mb(text):
        return int(re.search(r"\] reference \d+ MB: .*weights (\d+) MB", text).group(1))

    # the memory plan sizes the reference's own weights: 384 wide against the tiny policy's 128
    assert reference_weights_mb(out) >= 3 * reference_weights_mb(plain) > 0


def test_the_kl_to_a_teacher_as_the_only_reward_distils_it(rlhf):
    """Sampled-token on-policy distillation on the RL loop (docs/algorithms.md): the SFT stage's model as the
    reference, its k1 KL as the whole reward (the task's weighted 0, and judging the held-out sums only). The
    base student's held-out exact match (0.30) ends near the teacher's (0.58-0.67 against 0.59-0.68 over seeds
    and teachers, and without vector kernels) and the KL to the teacher falls from about 0.2 to below 0.02."""
    from rlhf_plugins.models.tiny_model import task_rows
    from rlhf_plugins.stages.heldout import evaluate_model

    code, _, err = rlhf("sft", "--train.run_name", "teacher", "--train.progress", "false")
    assert code == 0, err
    code, _, err = rlhf("train", "--model.reference_path", "runs/teacher/final", "--reward.weights", "0",
                        "--algo.kl.in_reward", "true", "--algo.kl.estimator", "k1", "--algo.kl.coef", "1",
                        "--eval.reward_functions", "exact_match", "--train.steps", "100", "--train.progress", "false",
                        "--train.run_name", "student")
    assert code == 0, err
    assert "weighted 0" not in err  # the held-out prompts are judged: no warning
    rows = metrics_of(Path("runs/student"))
    before, after = (r["eval/pass@1"] for r in eval_rows_of(Path("runs/student")))
    teacher = evaluate_model("runs/teacher/final", task_rows("test"), n=8)["pass@1"]
    assert before < 0.4 and teacher >= 0.45 and after >= max(before + 0.15, teacher - 0.15), (before, after, teacher)
    kl = [r["kl/rollout"] for r in rows if "kl/rollout" in r]
    assert kl[0] > 0.1 and sum(kl[-10:]) / 10 < kl[0] / 5, (kl[0], kl[-10:])
    assert all(r["reward/mean"] == 0.0 for r in rows if "reward/mean" in r)  # the teacher was the only signal


def test_a_run_whose_rewards_all_weigh_nothing_is_told_how_to_judge_its_held_out_prompts(rlhf):
    """With every source weighted 0 the held-out evaluation, which judges with the run's reward, can only say 0:
    one warning line names --eval.reward_functions (the distillation recipe above gives it and gets none)."""
    code, out, err = rlhf("train", "--reward.weights", "0", "--train.steps", "1", "--train.progress", "false")
    assert code == 0, err
    assert ("rlhf: warning: every reward source is weighted 0 (reward.weights), and the held-out evaluation judges "
            "with the run's reward: its pass@k will be 0; give --eval.reward_functions NAME to judge it") in err
    assert "pass@1 0.000 -> 0.000" in " ".join(out.split())


def test_mixing_gives_alpha_policy_plus_the_rest_of_the_reference_and_a_tied_tensor_once():
    from rlhf_plugins.models.weights import load_named_weights

    g = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(11, 6), torch.nn.Linear(6, 11))
    model[1].weight = model[0].weight  # an output head tied to the embedding
    before = {k: v.clone() for k, v in model.state_dict().items()}
    given = {"0.weight": torch.randn(11, 6, generator=g), "1.bias": torch.randn(11, generator=g)}
    info = load_named_weights(model, given.items(), mix=0.3, receiver="the reference model")
    assert info["tensors"] == 2
    for name, want in (("0.weight", 0.3 * given["0.weight"].double() + 0.7 * before["0.weight"].double()),
                       ("1.bias", 0.3 * given["1.bias"].double() + 0.7 * before["1.bias"].double())):
        torch.testing.assert_close(model.state_dict()[name].double(), want, rtol=0, atol=1e-6)
    assert model[1].weight is model[0].weight  # still one tensor, moved once
    with pytest.raises(Exception, match="does not fit the reference model: unknown names"):
        load_named_weights(model, [("head.weight", torch.zeros(2))], mix=0.3, receiver="the reference model")


def test_the_reference_moves_towards_the_policy_every_n_steps(tiny_model, tmp_path, monkeypatch):
    """ref_sync_steps 2, alpha 0.6: after steps 2 and 4 (not 1 and 3) every reference tensor is
    0.6 x the policy's + 0.4 x its own before; the steps in between leave it as it was."""
    monkeypatch.chdir(tmp_path)
    t = in_process_trainer(tiny_model, {"train": {"prompts_per_step": 4, "steps": 4},
                                        "generation": {"n_samples_per_prompt": 4},
                                        "algo": {"kl": {"coef": 0.05, "ref_sync_steps": 2, "ref_mixup_alpha": 0.6}}})
    try:
        initial = t.reference.run(_reference_weights, rank=0)
        ref = initial
        for step in range(4):
            metrics = t.step(step)
            now, policy = t.reference.run(_reference_weights, rank=0), t.actor.run(_policy_weights, rank=0)
            if step % 2 == 1:
                assert metrics["reference/refreshed"] == 1.0 and metrics["reference/tensors"] == len(policy)
                for name, p in policy.items():
                    want = 0.6 * p.double() + 0.4 * ref[name].double()
                    torch.testing.assert_close(now[name].double(), want, rtol=0, atol=1e-6)
            else:
                assert "reference/refreshed" not in metrics
                assert all(torch.equal(now[k], ref[k]) for k in now)
            ref = now
        assert any(not torch.equal(ref[k], initial[k]) for k in ref)
    finally:
        t.shutdown()


@pytest.mark.parametrize("lora", [{}, {"lora": {"rank": 4, "target_modules": ["q_proj", "v_proj"]}}],
                         ids=["full", "lora"])
def test_with_alpha_one_the_kl_right_after_a_move_is_zero(tiny_model, tmp_path, monkeypatch, lora):
    """Alpha 1 makes the reference the policy (a LoRA policy's adapters merged): the next update's KL
    term (one update per rollout, measured before it changes anything) is zero, while the step before
    it had moved away."""
    monkeypatch.chdir(tmp_path)
    t = in_process_trainer(tiny_model, {"train": {"prompts_per_step": 4, "steps": 3}, **lora,
                                        "learner": {"lr": 5e-3}, "generation": {"n_samples_per_prompt": 4},
                                        "algo": {"kl": {"coef": 0.05, "ref_sync_steps": 2, "ref_mixup_alpha": 1.0}}})
    try:
        kl = [t.step(step)["kl"] for step in range(2)]
        ref, policy = t.reference.run(_reference_weights, rank=0), t.actor.run(_policy_weights, rank=0)
        kl.append(t.step(2)["kl"])
    finally:
        t.shutdown()
    assert set(policy) <= set(ref) and all(torch.equal(ref[name], p) for name, p in policy.items())
    assert kl[1] > 1e-6  # one update away from the initial policy
    assert abs(kl[2]) < 1e-6  # the reference is the policy that sampled step 3


def test_resuming_after_a_move_continues_with_the_moved_reference(rlhf):
    run = [*short_run(), "--train.steps", "4", "--train.save_every", "2", "--train.keep_checkpoints", "0",
           "--algo.kl.coef", "0.05", "--algo.kl.ref_sync_steps", "1"]
    code, _, err = rlhf("train", *run, "--train.run_name", "whole")
    assert code == 0, err
    code, _, err = rlhf("train", *run, "--train.run_name", "again")
    assert code == 0, err
    again = Path("runs") / "again"
    assert (again / "checkpoints" / "step-000002" / "reference").is_dir()
    code, _, err = rlhf("train", "--resume", str(again / "checkpoints" / "step-000002"))
    assert code == 0, err

    def comparable(rows):
        return [{k: v for k, v in r.items() if not k.startswith(MEASURED)} for r in rows]

    whole, resumed = metrics_of(again.parent / "whole"), metrics_of(again)
    assert [r["step"] for r in resumed] == list(range(4))
    assert comparable(resumed) == comparable(whole)
    assert all(r["reference/refreshed"] == 1.0 for r in whole)


@pytest.mark.parametrize("extra, says", [
    (("--algo.kl.coef", "0"), "algo.kl.coef 0 runs without one"),
    (("--train.max_staleness", "1", "--algo.policy_loss.mismatch", "tis"), "rollouts made ahead"),
    (("--algo.kl.ref_mixup_alpha", "0"), "ref_mixup_alpha"),
])
def test_runs_that_cannot_move_their_reference_are_refused_in_one_line(rlhf, extra, says):
    code, _, err = rlhf("train", *short_run(), "--algo.kl.ref_sync_steps", "2", *extra)
    assert code == 2 and err.strip().count("\n") == 0, err
    assert says in err
    assert not Path("runs").exists()  # refused before anything is written


@pytest.mark.parametrize("fields, steps, note", [
    ({"sync_ref_model": True, "beta": 0.04, "ref_model_sync_steps": 4, "ref_model_mixup_alpha": 0.9}, 4, None),
    ({"sync_ref_model": True, "beta": 0.04, "ref_model_sync_steps": 8, "num_iterations": 2}, 4, None),
    ({"sync_ref_model": True, "beta": 0.04, "ref_model_sync_steps": 3, "num_iterations": 2}, 2,
     "ref_model_sync_steps 3 is 1.5"),
    ({"ref_model_sync_steps": 8, "beta": 0.04}, None, None),
])
def test_trl_sync_ref_model_maps_to_reference_moves_counted_in_rollouts(fields, steps, note):
    from rlhf_plugins.integrations.trl_config import from_grpo_fields

    raw, notes = from_grpo_fields(fields)
    kl = raw["algo"].get("kl", {})
    assert kl.get("ref_sync_steps") == steps
    if steps is not None:
        assert kl["ref_mixup_alpha"] == fields.get("ref_model_mixup_alpha", 0.6)  # TRL's default 0.6
    assert any(note in n for n in notes) if note else not any("ref_model_sync_steps" in n for n in notes)


def test_a_trl_config_with_sync_ref_model_trains_with_a_moving_reference(rlhf, tmp_path):
    import yaml

    cfg = tmp_path / "grpo.yaml"
    cfg.write_text(yaml.safe_dump({"sync_ref_model": True, "beta": 0.04, "ref_model_sync_steps": 2,
                                   "ref_model_mixup_alpha": 0.5, "num_generations": 4,
                                   "per_device_train_batch_size": 16, "max_completion_length": 6, "max_steps": 2}))
    code, _, err = rlhf("train", "--trl-config", str(cfg), "--train.progress", "false", "--eval.enabled", "false")
    assert code == 0, err
    saved = yaml.safe_load((the_run() / "config.yaml").read_text())
    assert saved["algo"]["kl"]["ref_sync_steps"] == 2 and saved["algo"]["kl"]["ref_mixup_alpha"] == 0.5
    assert ["reference/refreshed" in r for r in metrics_of(the_run())] == [False, True]


def test_trl_sync_ref_model_without_a_reference_is_refused_as_trl_does():
    from rlhf_plugins.errors import ConfigError
    from rlhf_plugins.integrations.trl_config import from_grpo_fields

    with pytest.raises(ConfigError, match="'sync_ref_model' moves the reference model, and beta 0"):
        from_grpo_fields({"sync_ref_model": True, "beta": 0.0})


@pytest.mark.integration
@pytest.mark.parametrize("colocate", ["none", "hybrid"])
def test_on_ray_the_reference_actor_receives_the_policy(local_ray, tiny_model, tmp_path, monkeypatch, colocate):
    """Reference and actor in Ray actors of their own (sent from the actor's process to the
    reference's), or in one actor (--ray.colocate hybrid: mixed in there): with alpha 1 the reference
    holds exactly the policy's weights after the move."""
    monkeypatch.chdir(tmp_path)
    t = in_process_trainer(tiny_model, {"placement": {"strategy": "ray"}, "ray": {"colocate": colocate},
                                        "train": {"prompts_per_step": 2, "steps": 2},
                                        "generation": {"n_samples_per_prompt": 2},
                                        "algo": {"kl": {"coef": 0.05, "ref_sync_steps": 2, "ref_mixup_alpha": 1.0}}})
    try:
        assert t.actor.hosted_with(t.reference) == (colocate == "hybrid")  # the two paths of refresh_reference
        first = t.reference.run(_reference_weights, rank=0)
        t.step(0)
        assert all(torch.equal(v, first[k]) for k, v in t.reference.run(_reference_weights, rank=0).items())
        assert t.step(1)["reference/refreshed"] == 1.0
        ref, policy = t.reference.run(_reference_weights, rank=0), t.actor.run(_policy_weights, rank=0)
    finally:
        t.shutdown()
    assert policy and all(torch.equal(ref[name], p) for name, p in policy.items())
    assert any(not torch.equal(ref[k], first[k]) for k in policy)


@pytest.mark.integration
def test_on_ray_the_reference_actor_loads_a_reference_of_its_own(local_ray, tiny_model, other_reference, tmp_path,
                                                                 monkeypatch):
    """--model.reference_path on Ray: the reference actor holds that folder's weights and a step runs with them."""
    monkeypatch.chdir(tmp_path)
    t = in_process_trainer(tiny_model, {"placement": {"strategy": "ray"}, "model": {"reference_path": other_reference},
                                        "train": {"prompts_per_step": 2, "steps": 1},
                                        "generation": {"n_samples_per_prompt": 2}, "algo": {"kl": {"coef": 0.05}}})
    try:
        held = t.reference.run(_reference_weights, rank=0)
        kl = t.step(0)["kl"]
    finally:
        t.shutdown()
    saved = _saved_weights(other_reference)
    assert all(torch.equal(held[k], v) for k, v in saved.items()) and kl > 1e-3


def _gathered_reference(ctx):
    """The sharded reference's full tensors (every rank gathers: collective)."""
    return {name: p.full_tensor().detach().clone() for name, p in ctx.backend.model.named_parameters()}


@pytest.mark.integration
def test_a_reference_sharded_by_fsdp_moves_and_comes_back_from_a_checkpoint(local_ray, tiny_model, tmp_path,
                                                                              monkeypatch):
    """The reference on the FSDP2 learner over two Ray ranks: with alpha 1 each rank's rows become the
    policy's after a move; its checkpoint folder, loaded after a later move, brings back the saved one."""
    from rlhf_plugins.training.reference_sync import load_reference, save_reference

    monkeypatch.chdir(tmp_path)
    t = in_process_trainer(tiny_model, {"placement": {"strategy": "ray"}, "learner": {"backend": "fsdp"},
                                        "ray": {"reference_workers": 2}, "train": {"prompts_per_step": 2, "steps": 4},
                                        "generation": {"n_samples_per_prompt": 2},
                                        "algo": {"kl": {"coef": 0.05, "ref_sync_steps": 1, "ref_mixup_alpha": 1.0}}})
    try:
        assert t.plan.learner.shards_reference
        first = t.reference.run(_gathered_reference)[0]
        t.step(0)
        moved, policy = t.reference.run(_gathered_reference)[0], dict(t.actor.named_weights())
        assert save_reference(t, tmp_path / "reference")
        t.step(1)
        later = t.reference.run(_gathered_reference)[0]
        load_reference(t, tmp_path / "reference")
        back = t.reference.run(_gathered_reference)[0]
    finally:
        t.shutdown()
    assert set(policy) <= set(moved) and all(torch.equal(moved[name], p) for name, p in policy.items())
    assert any(not torch.equal(moved[k], first[k]) for k in moved)
    assert any(not torch.equal(later[k], moved[k]) for k in moved)
    assert all(torch.equal(back[k], moved[k]) for k in moved)
