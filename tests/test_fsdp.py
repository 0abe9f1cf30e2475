"""The FSDP2 learner (``--learner.backend fsdp``) against the torch learner on the same batch: one
rank in this process, two ranks as Ray actors (gloo); LoRA, the critic, checkpoints with exact resume
and the full-model export."""
from __future__ import annotations

import json

import pytest
import torch

from rlhf_plugins.algorithms import policy_losses
from rlhf_plugins.algorithms.objective import Objective
from rlhf_plugins.api import prepare
from rlhf_plugins.testing import backend_context
from tests.helpers import random_batch

LR = 1e-4


def the_batch(seed: int = 5) -> dict:
    batch = random_batch(group=4, prompts=4, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    batch["advantages"] = torch.randn(batch["action_mask"].shape, generator=g) * batch["action_mask"]
    return batch


def learner(backend: str, tiny_model: str, role: str = "actor", **raw):
    from rlhf_plugins.learners.fsdp_learner import FSDPLearner
    from rlhf_plugins.learners.torch_learner import TorchLearner

    base = {"train": {"prompts_per_step": 4}, "generation": {"n_samples_per_prompt": 4}}
    learner_options = {"lr": LR, "backend": backend, **raw.pop("learner", {})}
    config, pm, _ = prepare({**base, **raw, "learner": learner_options}, autoload=False)
    cls = FSDPLearner if backend == "fsdp" else TorchLearner
    return cls(backend_context(config, role, tiny_model, pm)), config


def objective_of(config):
    return Objective(policy_losses.ppo, config.algo.policy_loss)


def assert_same_update(got, expected, after, after_torch, before, tol=1e-6):
    assert got["loss/policy"] == pytest.approx(expected["loss/policy"], abs=1e-6)
    assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)
    moved = max(float((after_torch[k] - before[k]).abs().max()) for k in before)
    worst = max(float((after[k] - after_torch[k]).abs().max()) for k in before)
    assert moved > 0.5 * LR and worst < tol, (moved, worst)


def torch_update(tiny_model, **raw):
    """The torch learner's update on the batch: metrics, weights before and after."""
    local, config = learner("torch", tiny_model, **raw)
    before = {k: v.clone() for k, v in local.named_weights()}
    metrics = local.train(the_batch(), objective_of(config))
    return metrics, before, {k: v.clone() for k, v in local.named_weights()}


@pytest.fixture(scope="module")
def reference_update(tiny_model):
    return torch_update(tiny_model)


@pytest.mark.parametrize("options", [{}, {"logits_memory_mb": 0.02}, {"max_tokens_per_micro_batch": 48},
                                     {"compile": True}, {"compile": True, "compile_scope": "layers"},
                                     {"gradient_checkpointing": True}, {"weight_decay": 0.5}],
                         ids=["whole-logits", "logits-in-chunks", "packed-micro-batches", "compiled", "compiled-layers",
                              "checkpointed", "weight-decay"])
def test_one_rank_matches_the_torch_learner(tiny_model, options, monkeypatch):
    """Loss, gradient norm (after clipping's reduction over shards) and weights after one AdamW step;
    also with the output head applied over chunks of tokens outside the model's own forward (what a
    real vocabulary triggers: the root's gathered head must last through the recomputation), with
    packed micro batches of at most 48 tokens (the micro-batch weights keep the batch's loss; each
    group's prompt once), and with --learner.compile on both sides (the compiled norms and MLPs, or
    whole decoder layers, inside each FSDP unit run on its gathered weights), and with gradient
    checkpointing (each unit gathered again for its recomputation, the shared prompt's cache read again)."""
    from rlhf_plugins.models.logits import chunking

    expected, before, after_torch = torch_update(tiny_model, learner=dict(options))
    fsdp, config = learner("fsdp", tiny_model, learner=dict(options))
    n_tokens = int(the_batch()["sequences"].numel())
    assert (chunking(fsdp.model, n_tokens, config.learner.logits_memory_mb) is not None) == ("logits_memory_mb" in options)
    from torch.distributed.tensor import DTensor

    assert all(isinstance(p, DTensor) for p in fsdp.model.parameters())  # really sharded
    gathered = dict(fsdp.named_weights())
    assert gathered.keys() == before.keys() and all(torch.equal(gathered[k], before[k]) for k in before)
    # built empty and filled from the checkpoint's files (one rank: all of every tensor)
    assert fsdp.shard_bytes_read == 4 * sum(v.numel() for v in before.values())
    from rlhf_plugins.learners import base

    groups = []
    split = base.token_budget_split
    monkeypatch.setattr(base, "token_budget_split", lambda batch, budget, group: groups.append(group) or split(
        batch, budget, group))
    got = fsdp.train(the_batch(), objective_of(config))
    assert_same_update(got, expected, dict(fsdp.named_weights()), after_torch, before)
    # packed micro batches hold each group's prompt once, as the torch learner's do
    assert groups == ([4] if "max_tokens_per_micro_batch" in options else [])
    if options.get("compile"):
        from rlhf_plugins.models.compiled import compiled_blocks

        layers = options.get("compile_scope") == "layers"  # whole decoder layers and the final norm
        assert len(compiled_blocks(fsdp.model)) == (3 if layers else 7)


def test_a_tied_head_model_loads_empty_tied_and_matches_the_torch_learner():
    """A real-vocabulary Qwen shape with its output head tied to the embedding (the checkpoint stores
    the embedding once): built empty with the head still tied, the embedding read once, the same
    update as the torch learner's."""
    from rlhf_plugins.models.empty_init import build_empty
    from rlhf_plugins.testing import reduced_model_path

    path = reduced_model_path()
    empty = build_empty(path, torch.float32, False)
    assert empty is not None and empty.get_output_embeddings().weight is empty.get_input_embeddings().weight
    expected, before, after_torch = torch_update(path)
    fsdp, config = learner("fsdp", path)
    assert fsdp.model.get_output_embeddings().weight is fsdp.model.get_input_embeddings().weight
    stored = {k: v for k, v in before.items() if k != "lm_head.weight"}
    assert fsdp.shard_bytes_read == 4 * sum(v.numel() for v in stored.values())
    got = fsdp.train(the_batch(), objective_of(config))
    assert_same_update(got, expected, dict(fsdp.named_weights()), after_torch, before)


def test_a_tied_head_is_gathered_synced_and_exported_once(tmp_path):
    """The tied output head is the embedding: the learners give it once, under the embedding's name
    (a sync moves 0.54 GB less at 0.5B; FSDP gathers it once), and the export loads back tied."""
    from transformers import AutoModelForCausalLM

    from rlhf_plugins.testing import reduced_model_path

    path = reduced_model_path()
    for backend in ("torch", "fsdp"):
        one, _ = learner(backend, path)
        names = [n for n, _ in one.named_weights()]
        assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names and len(set(names)) == len(names)
    one.save(str(tmp_path / "export"))
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "export"))
    assert loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight
    weights = dict(one.named_weights())
    assert all(torch.equal(t, weights[n]) for n, t in loaded.named_parameters())


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_two_ranks_on_ray_match_the_torch_learner_on_the_whole_batch(local_ray, tiny_model, reference_update, lora):
    """Two Ray actors (gloo), each with half the batch and half of every tensor (each reading only its
    half of the checkpoint; LoRA's adapters made whole by PEFT, then halved): the same update as one
    torch learner on the whole batch."""
    from rlhf_plugins import PlacementContext
    from rlhf_plugins.placement.ray_placement import RayPlacement
    from rlhf_plugins.training.roles import PolicyRole

    extra = {"lora": {"rank": 4, "target_modules": ["q_proj", "v_proj"]}} if lora else {}
    expected, before, after_torch = torch_update(tiny_model, **extra) if lora else reference_update
    config, pm, plan = prepare({"placement": {"strategy": "ray"}, "learner": {"backend": "fsdp", "lr": LR},
                                "ray": {"actor_workers": 2}, "train": {"prompts_per_step": 4},
                                "generation": {"n_samples_per_prompt": 4}, **extra}, autoload=False)
    placement = RayPlacement(PlacementContext(config, ("actor",), plugin_spec=pm.spec))
    try:
        group = placement.create_role("actor", PolicyRole, config, pm.spec, tiny_model, plan.learner)
        shards = group.run(lambda ctx: sum(p.to_local().numel() for n, p in ctx.backend.model.named_parameters()
                                           if "lora_" not in n))
        read = group.run(lambda ctx: ctx.backend.shard_bytes_read)
        got = group.train(the_batch(), objective_of(config))
        after = dict(group.named_weights())
    finally:
        placement.shutdown()
    total = sum(v.numel() for k, v in before.items() if k != "lm_head.weight")
    assert len(shards) == 2 and max(shards) < 0.6 * total  # each rank holds about half
    assert [r // 4 for r in read] == shards  # ... and read only that half of the checkpoint (float32)
    assert_same_update(got, expected, after, after_torch, before, tol=1e-6)


def _set_fixed_grads(model: torch.nn.Module) -> None:
    """Every trainable parameter's gradient drawn from a generator seeded by its name (an FSDP2 shard
    gets its rows of the same whole gradient)."""
    import zlib

    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, p in model.named_parameters():
        if p.requires_grad:
            g = torch.randn(p.shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))
            p.grad = distribute_tensor(g, p.device_mesh, p.placements) if isinstance(p, DTensor) else g


def test_two_ranks_run_muon_on_their_row_shards_as_the_torch_learner_on_whole_matrices(local_ray, tiny_model):
    """--learner.optimizer muon on two FSDP2 ranks (Ray actors, gloo), each holding half the rows of
    every matrix: from the same gradients, one optimizer step moves every tensor as the torch learner's
    Muon + AdamW on whole tensors -- AdamW's to 1e-7 (0 measured), each hidden matrix by the orthogonalisation of its
    whole gradient up to the order of bf16 sums (DTensor gathers what each Newton-Schulz step needs);
    orthogonalising each rank's rows alone would be another update altogether (checked to be told apart:
    over 30% of the largest element apart, where the gaps allowed are 10% of each matrix's move; 3% measured)."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    from rlhf_plugins import PlacementContext
    from rlhf_plugins.learners.muon import uses_muon
    from rlhf_plugins.placement.ray_placement import RayPlacement
    from rlhf_plugins.training.roles import PolicyRole

    muon = {"optimizer": "muon", "muon_lr": 0.02}
    local, _ = learner("torch", tiny_model, learner=muon)
    before = {k: v.clone() for k, v in local.named_weights()}
    _set_fixed_grads(local.model)
    grads = {k: p.grad.clone() for k, p in local.model.named_parameters()}
    local.optimizer.step()
    after_torch = dict(local.named_weights())
    config, pm, plan = prepare({"placement": {"strategy": "ray"}, "learner": {"backend": "fsdp", "lr": LR, **muon},
                                "ray": {"actor_workers": 2}, "train": {"prompts_per_step": 4},
                                "generation": {"n_samples_per_prompt": 4}}, autoload=False)
    placement = RayPlacement(PlacementContext(config, ("actor",), plugin_spec=pm.spec))
    try:
        group = placement.create_role("actor", PolicyRole, config, pm.spec, tiny_model, plan.learner)
        set_grads = _set_fixed_grads
        group.run(lambda ctx: (set_grads(ctx.backend.model), ctx.backend.optimizer.step()))
        after = dict(group.named_weights())
    finally:
        placement.shutdown()
    hidden = [k for k in before if uses_muon(k, before[k])]
    assert len(hidden) == 14 and set(hidden) < set(before)
    for k in before:
        moved = float((after_torch[k] - before[k]).abs().max())
        gap = float((after[k] - after_torch[k]).abs().max())
        assert moved > 0.5 * min(LR, 0.02) and gap < (0.1 * moved if k in hidden else 1e-7), (k, moved, gap)
    k = max(hidden, key=lambda name: before[name].numel())
    rows = before[k].shape[0] // 2
    halves = torch.cat([_zeropower_via_newtonschulz(g, (3.4445, -4.7750, 2.0315), 5, 1e-7)
                        for g in (grads[k][:rows], grads[k][rows:])]).float()
    whole = _zeropower_via_newtonschulz(grads[k], (3.4445, -4.7750, 2.0315), 5, 1e-7).float()
    assert float((halves - whole).abs().max()) > 0.3 * float(whole.abs().max())


def test_a_reference_sharded_over_two_ranks_gives_the_whole_models_logprobs(local_ray, tiny_model):
    """The reference role on the FSDP learner over two Ray ranks: frozen (no optimizer, no gradients),
    each rank holding about half of the model, and the log-probs of the whole model."""
    from rlhf_plugins import PlacementContext
    from rlhf_plugins.placement.ray_placement import RayPlacement
    from rlhf_plugins.training.roles import ReferenceRole

    config, pm, plan = prepare({"placement": {"strategy": "ray"}, "learner": {"backend": "fsdp"},
                                "ray": {"reference_workers": 2}, "train": {"prompts_per_step": 4},
                                "generation": {"n_samples_per_prompt": 4}}, autoload=False)
    assert plan.learner.shards_reference
    batch = the_batch()
    whole = ReferenceRole(config, pm.spec, tiny_model).logprobs(batch)
    placement = RayPlacement(PlacementContext(config, ("reference",), plugin_spec=pm.spec))
    try:
        group = placement.create_role("reference", ReferenceRole, config, pm.spec, tiny_model, plan.learner)
        ranks = group.run(lambda ctx: (sum(p.to_local().numel() for p in ctx.backend.model.parameters()),
                                       sum(p.numel() for p in ctx.backend.model.parameters()),
                                       any(p.requires_grad for p in ctx.backend.model.parameters()),
                                       hasattr(ctx.backend, "optimizer")))
        sharded = group.logprobs(batch)
    finally:
        placement.shutdown()
    assert len(ranks) == 2 and all(local < 0.6 * total and not grad and not opt for local, total, grad, opt in ranks)
    # float32 rounding: the gathered shards can take other matmul kernels (1.9e-6 at -10 seen on an EPYC)
    torch.testing.assert_close(sharded, whole, rtol=1e-6, atol=1e-6)


def test_the_loader_builds_an_empty_model_only_for_a_checkpoint_under_its_own_names(tiny_model, tmp_path):
    """Empty: every parameter on the meta device, the buffers computed for real as from_pretrained
    makes them (rotary frequencies); a checkpoint with a tensor under another name loads whole."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from rlhf_plugins.models.empty_init import build_empty, source_of

    empty = build_empty(tiny_model, torch.float32, False)
    assert empty is not None and all(p.is_meta for p in empty.parameters()) and source_of(empty).folder == tiny_model
    whole = dict(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).named_buffers())
    buffers = dict(empty.named_buffers())
    assert buffers.keys() == whole.keys() and all(torch.equal(buffers[k], whole[k]) for k in whole)
    renamed = tmp_path / "renamed"
    shutil.copytree(tiny_model, renamed)
    (file,) = renamed.glob("*.safetensors")
    tensors = load_file(file)
    tensors["model.final_norm.weight"] = tensors.pop("model.norm.weight")
    save_file(tensors, file, metadata={"format": "pt"})
    assert build_empty(str(renamed), torch.float32, False) is None


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_checkpoint_resume_gives_the_same_next_update(tiny_model, tmp_path, optimizer):
    """Two updates, a checkpoint (torch.distributed.checkpoint), a fresh learner loads it: its next
    update equals the uninterrupted learner's, metrics and weights exactly (Muon's momentum and AdamW's
    moments, one optimizer's state, included)."""
    first, config = learner("fsdp", tiny_model, learner={"optimizer": optimizer})
    objective = objective_of(config)
    for seed in (1, 2):
        first.train(the_batch(seed), objective)
    first.save_checkpoint(str(tmp_path / "ckpt"))
    assert (tmp_path / "ckpt" / "fsdp" / ".metadata").is_file()
    expected = first.train(the_batch(3), objective)
    second, _ = learner("fsdp", tiny_model, learner={"optimizer": optimizer})
    second.load_checkpoint(str(tmp_path / "ckpt"))
    assert second.updates == 2
    got = second.train(the_batch(3), objective)
    assert got == expected
    a, b = dict(first.named_weights()), dict(second.named_weights())
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_checkpoint_whose_optimizer_decayed_everything_is_one_line_and_resumes_with_weight_decay_all(
        tiny_model, tmp_path):
    """A sharded checkpoint of an optimizer with one param group (every parameter decayed, as before biases
    and norms were left alone): DCP's missing-key failure becomes the line naming the flag, which resumes it."""
    from rlhf_plugins.errors import UsageError

    old = {"weight_decay": 0.1, "weight_decay_all": True}
    first, config = learner("fsdp", tiny_model, learner=old)
    first.train(the_batch(1), objective_of(config))
    first.save_checkpoint(str(tmp_path))
    expected = first.train(the_batch(2), objective_of(config))
    with pytest.raises(UsageError, match="resume it with --learner.weight_decay_all true"):
        learner("fsdp", tiny_model, learner={"weight_decay": 0.1})[0].load_checkpoint(str(tmp_path))
    again, _ = learner("fsdp", tiny_model, learner=old)
    again.load_checkpoint(str(tmp_path))
    assert again.train(the_batch(2), objective_of(config)) == expected


def test_the_export_loads_in_transformers_with_the_trained_weights(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    fsdp, config = learner("fsdp", tiny_model)
    fsdp.train(the_batch(), objective_of(config))
    fsdp.save(str(tmp_path / "export"))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    trained = dict(fsdp.named_weights())
    assert all(torch.equal(t, trained[n]) for n, t in loaded.state_dict().items())


def test_lora_trains_the_sharded_adapters_only_as_the_torch_learner_does(tiny_model):
    """The base built empty and read shard by shard, the adapters made whole by PEFT (its own
    initialisation, as the torch learner's whole load makes them) and sharded: the same update."""
    lora = {"lora": {"rank": 4, "target_modules": ["q_proj", "v_proj"]}}
    runs = {}
    for backend in ("torch", "fsdp"):
        one, config = learner(backend, tiny_model, **lora)
        before = {n: t.clone() for n, t in one.raw_named_weights()}
        metrics = one.train(the_batch(), objective_of(config))
        runs[backend] = metrics, before, dict(one.raw_named_weights())
    assert one.shard_bytes_read == 4 * sum(v.numel() for k, v in runs["torch"][1].items() if "lora_" not in k)
    (m_t, before_t, after_t), (m_f, before_f, after_f) = runs["torch"], runs["fsdp"]
    assert before_f.keys() == before_t.keys() and all(torch.equal(before_f[k], before_t[k]) for k in before_t)
    changed = {k for k in after_f if not torch.equal(after_f[k], before_f[k])}
    assert changed and all("lora_" in k for k in changed)  # the base stays frozen
    assert m_f["loss/policy"] == pytest.approx(m_t["loss/policy"], abs=1e-6)
    assert max(float((after_f[k] - after_t[k]).abs().max()) for k in after_t) < 1e-6


def test_the_critic_trains_on_fsdp_as_on_torch(tiny_model):
    """The value head's model sharded like the policy: values, then one value-loss update."""
    from rlhf_plugins.algorithms.value import ValueObjective

    batch = the_batch()
    batch["returns"] = torch.randn(batch["action_mask"].shape, generator=torch.Generator().manual_seed(9))
    out = {}
    for backend in ("torch", "fsdp"):
        critic, config = learner(backend, tiny_model, role="critic", algo={"advantage": {"estimator": "gae"}})
        values = critic.logprobs(batch)
        batch["values"] = values
        out[backend] = values, critic.train(batch, ValueObjective(config.critic.value_clip))
    assert critic.shard_bytes_read == 4 * sum(p.numel() for n, p in critic.raw_named_weights() if "value_head" not in n)
    torch.testing.assert_close(out["fsdp"][0], out["torch"][0], rtol=0, atol=1e-6)
    assert out["fsdp"][1]["critic/loss"] == pytest.approx(out["torch"][1]["critic/loss"], abs=1e-6)
    assert out["fsdp"][1]["critic/grad_norm"] == pytest.approx(out["torch"][1]["critic/grad_norm"], rel=1e-5)


def test_an_in_place_op_on_the_sharded_forwards_outputs_keeps_the_gradient(tiny_model):
    """A critic's values are a view of its head's output ([..., 0]). An in-place op on what the sharded root
    returns (a plugin's loss may make one) dropped FSDP2's pre-backward hook: the backward then read the
    resharded weights and failed ("storage of size 0"). Now the root returns no views: the gradients equal the
    torch learner's under the same in-place op."""
    batch, grads = the_batch(), {}
    for backend in ("torch", "fsdp"):
        critic, _ = learner(backend, tiny_model, role="critic", algo={"advantage": {"estimator": "gae"}})
        values = critic.forward(critic._module(), batch, 1.0)["values"]
        values.mul_(2.0)
        (values * batch["action_mask"]).sum().backward()
        grads[backend] = {n.replace("_fsdp_wrapped_module.", ""): getattr(p.grad, "full_tensor", lambda g=p.grad: g)()
                          for n, p in critic.model.named_parameters() if p.grad is not None}
    assert grads["fsdp"].keys() == grads["torch"].keys() and len(grads["torch"]) > 10
    for name, want in grads["torch"].items():
        torch.testing.assert_close(grads["fsdp"][name], want, rtol=1e-5, atol=1e-7)


SHORT = ["--train.prompts_per_step", "4", "--generation.n_samples_per_prompt", "4", "--train.progress", "false",
         "--train.save_every", "2", "--eval.enabled", "false", "--learner.backend", "fsdp"]


def train(cwd, *args, env=None):
    from tests.helpers import run_subprocess

    return run_subprocess("train", *args, cwd=cwd, env={"RLHF_DISABLE_PLUGIN_AUTOLOAD": "1", **(env or {})})


def test_kill_9_then_resume_gives_the_same_metrics_step_for_step(tmp_path, tiny_model):
    """`rlhf train --learner.backend fsdp` SIGKILLed one step past its step-2 checkpoint, resumed:
    the same metrics as the uninterrupted run, step for step, and the final export loads."""
    from rlhf_plugins.training.runlog import MEASURED
    from tests.helpers import KILLER, metrics_of

    (tmp_path / "killer.py").write_text(KILLER)
    whole = train(tmp_path, "--plugin", "killer.py", *SHORT, "--train.steps", "5", "--train.run_name", "whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    killed = train(tmp_path, "--plugin", "killer.py", *SHORT, "--train.steps", "5", "--train.run_name", "killed",
                   env={"KILL_AT": "step 2"})
    assert killed.returncode == -9, killed.stderr[-3000:]
    run = tmp_path / "runs" / "killed"
    assert list((run / "checkpoints" / "step-000002" / "actor" / "fsdp").glob("*.distcp"))
    resumed = train(tmp_path, "--resume", str(run))
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr[-3000:]
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith(MEASURED)} for r in rows]  # noqa: E731
    assert strip(metrics_of(run)) == strip(metrics_of(tmp_path / "runs" / "whole"))
    assert [r["step"] for r in metrics_of(run)] == list(range(5))
    assert (run / "final" / "config.json").is_file()


#: records each weight sync's engine/learner log-prob gap (--sync.verify) into parity.jsonl
PARITY = """
import json
from rlhf_plugins import hookimpl

@hookimpl
def rlhf_after_weight_sync(step, info):
    with open("parity.jsonl", "a") as f:
        f.write(json.dumps(info["parity_max_abs_diff"]) + "\\n")
"""


def test_rlhf_train_on_ray_with_two_fsdp_ranks_resumes_its_sharded_checkpoint(tmp_path, tiny_model):
    """Two FSDP ranks as Ray actors, broadcast sync to the engine checked every step (--sync.verify),
    the reference model sharded over two ranks of its own (KL 0 at the first step: it is the initial
    policy); each rank writes its shards of the step-2 checkpoint; a copy resumed from it makes steps
    2-3 as the whole run made them."""
    import shutil

    from tests.helpers import metrics_of

    (tmp_path / "parity.py").write_text(PARITY)
    ray = ["--placement.strategy", "ray", "--ray.local_num_gpus", "5", "--ray.actor_workers", "2",
           "--ray.reference_workers", "2", "--algo.kl.coef", "0.05", "--sync.verify", "true"]
    whole = train(tmp_path, *SHORT, *ray, "--plugin", "parity.py", "--train.steps", "4", "--train.run_name", "whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    runs = tmp_path / "runs"
    shutil.copytree(runs / "whole", runs / "part")
    ckpt = runs / "part" / "checkpoints" / "step-000002"
    assert {p.name for p in (ckpt / "actor").glob("*rank*.pt")} >= {"learner-rank0.pt", "learner-rank1.pt"}
    assert len(list((ckpt / "actor" / "fsdp").glob("*.distcp"))) == 2  # one file of shards per rank
    resumed = train(tmp_path, "--resume", str(ckpt))
    assert resumed.returncode == 0 and "after step 2" in resumed.stdout, resumed.stderr[-3000:]
    part, full = metrics_of(runs / "part"), metrics_of(runs / "whole")
    assert [r["step"] for r in part] == [0, 1, 2, 3]
    for a, b in zip(part[2:], full[2:]):
        for k in ("loss/policy", "reward/mean", "kl", "grad_norm"):
            assert a[k] == pytest.approx(b[k], abs=1e-6), k
    gaps = [json.loads(line) for line in (tmp_path / "parity.jsonl").read_text().splitlines()]
    assert len(gaps) >= 4 and all(g < 1e-4 for g in gaps[:4])  # the whole run's four syncs
    assert full[0]["kl"] == pytest.approx(0.0, abs=1e-6) and full[-1]["kl"] > 1e-6
    reference = json.loads((runs / "whole" / "summary.json").read_text())["memory"]["reference"]
    assert reference["ranks"] == 2.0 and reference["analytic_gb"] > 0


def test_fsdp_memory_items_by_hand():
    """Two ranks, float32, AdamW: a rank holds half of the weights, gradients and both Adam states,
    plus two gathered layers (the one computing, the next prefetched) -- the largest unit here is a
    400-element tensor."""
    from rlhf_plugins.config.schema import Config
    from rlhf_plugins.models.memory import MemoryInputs, ModelShape, fsdp_learner_memory

    shape = ModelShape(parameters=1000, layer_parameters=300, largest_tensor=400, vocab=50, hidden=8,
                       intermediate=16, layers=2, q_dim=8, kv_dim=4, tied=True)
    items = fsdp_learner_memory(MemoryInputs(Config(), shape, "actor", ranks=2, trainable=1000, micro_tokens=0,
                                             logits_bytes=0))
    assert items == {"weights": 2000, "gathered layers": 3200, "gradients": 2000, "optimizer states": 4000}
    frozen = fsdp_learner_memory(MemoryInputs(Config(), shape, "reference", ranks=2, trainable=1000, micro_tokens=0,
                                              logits_bytes=0))
    assert frozen == {"weights": 2000, "gathered layers": 3200}  # the reference: no gradients, no optimizer


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_sharded_critic_exports_what_the_critic_loader_reads(tiny_model, tmp_path, lora):
    """The critic's export from gathered tensors: the backbone under its own names and the trained
    value head in its own file (whole model: ValueModel.from_pretrained gets every trained tensor back;
    LoRA: the adapter and the head)."""
    from safetensors.torch import load_file

    from rlhf_plugins.algorithms.value import ValueObjective
    from rlhf_plugins.models.value_model import HEAD_FILE, ValueModel

    batch = the_batch()
    batch["returns"] = torch.randn(batch["action_mask"].shape, generator=torch.Generator().manual_seed(9))
    extra = {"lora": {"rank": 4, "target_modules": ["q_proj", "v_proj"]}} if lora else {}
    critic, config = learner("fsdp", tiny_model, role="critic", algo={"advantage": {"estimator": "gae"}}, **extra)
    batch["values"] = critic.logprobs(batch)
    critic.train(batch, ValueObjective(config.critic.value_clip))
    critic.save(str(tmp_path / "critic"))
    trained = dict(critic.raw_named_weights())
    head = load_file(str(tmp_path / "critic" / HEAD_FILE))
    assert torch.equal(head["weight"], trained["value_head.weight"]) and head["weight"].abs().sum() > 0
    if lora:
        assert (tmp_path / "critic" / "adapter_config.json").is_file()
        return
    loaded = ValueModel.from_pretrained(str(tmp_path / "critic")).state_dict()
    assert loaded.keys() == trained.keys() and all(torch.equal(loaded[k], trained[k]) for k in trained)
    # a sharded critic started from the saved folder reads its backbone's shards and the saved head
    again, _ = learner("fsdp", str(tmp_path / "critic"), role="critic", algo={"advantage": {"estimator": "gae"}})
    assert again.shard_bytes_read == 4 * sum(v.numel() for k, v in trained.items() if "value_head" not in k)
    restored = dict(again.raw_named_weights())
    assert restored.keys() == trained.keys() and all(torch.equal(restored[k], trained[k]) for k in trained)


def test_a_float32_head_in_a_bfloat16_model_computes_in_float32_and_trains_as_on_the_torch_learner(tiny_model):
    """--model.fp32_lm_head on FSDP2: inside the sharded forward the head's gathered weight and its logits
    are float32 (the root unit -- embedding, final norm, head -- computes in float32; the decoder layers in
    bfloat16), and one rank's update is the torch learner's (float32 head, bfloat16 weights beside float32
    masters) but for the root's extra precision: the same loss, the gradient norm within 0.2%."""
    raw = {"model": {"dtype": "bfloat16", "fp32_lm_head": True}}
    expected, before, after_torch = torch_update(tiny_model, **raw)
    fsdp, config = learner("fsdp", tiny_model, **raw)
    seen = []
    head = fsdp.model.get_output_embeddings()
    hook = head.register_forward_hook(lambda module, args, out: seen.append((module.weight.dtype, out.dtype)))
    layer = fsdp.model.model.layers[0].self_attn.q_proj
    hook_layer = layer.register_forward_hook(lambda module, args, out: seen.append(("layer", module.weight.dtype)))
    got = fsdp.train(the_batch(), objective_of(config))
    hook.remove(), hook_layer.remove()
    assert (torch.float32, torch.float32) in seen and ("layer", torch.bfloat16) in seen, seen
    assert all(entry in {(torch.float32, torch.float32), ("layer", torch.bfloat16)} for entry in seen), seen
    assert got["loss/policy"] == pytest.approx(expected["loss/policy"], abs=1e-6)
    assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=2e-3)
    after = dict(fsdp.named_weights())
    assert after["lm_head.weight"].dtype == after_torch["lm_head.weight"].dtype == torch.float32
    assert not torch.equal(after["lm_head.weight"], before["lm_head.weight"])
