"""--learner.optimizer muon (OpenRLHF's --optim muon): which tensors Muon steps, its step against
torch's Muon and AdamW run apart, the orthogonalised update measured by its singular values, the
schedule on both halves, exact resume of the optimizer, a run, DeepSpeed's own Muon over two ZeRO-3
ranks, and OpenRLHF's flags."""
from __future__ import annotations

import copy

import pytest
import torch

from rlhf_plugins.algorithms import policy_losses
from rlhf_plugins.algorithms.objective import Objective
from rlhf_plugins.api import prepare
from rlhf_plugins.learners.muon import MuonWithAdamW, uses_muon
from tests.helpers import metrics_of, ppo_batch, random_batch, short_run, the_run, torch_learner

needs_muon = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs torch 2.9+")

HIDDEN = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def settings(**learner):
    config, _, _ = prepare({"learner": {"optimizer": "muon", "lr": 1e-3, "weight_decay": 0.01, **learner}},
                           autoload=False)
    return config.learner


@needs_muon
def test_muon_steps_the_hidden_matrices_and_adamw_the_rest(tiny_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    named = list(model.named_parameters())
    muon = {n for n, p in named if uses_muon(n, p)}
    assert muon and all(any(h in n for h in HIDDEN) and n.endswith("weight") for n in muon)
    assert {n for n, _ in named} - muon >= {"model.embed_tokens.weight", "model.norm.weight"}
    opt = MuonWithAdamW(named, settings(), 1e-3)
    kinds = [type(p).__name__ for p in opt.parts]
    assert kinds == ["AdamW", "Muon"] and [g["lr"] for g in opt.param_groups] == [1e-3, 0.02]


def fake_grads(named, seed):
    g = torch.Generator().manual_seed(seed)
    for _, p in named:
        p.grad = torch.randn(p.shape, generator=g) * torch.rand(p.shape[-1:], generator=g) * 3  # uneven columns


@needs_muon
def test_the_memory_plan_counts_the_optimizer_states_a_step_makes(tiny_model):
    """The analytic optimizer states of a Muon run equal the elements of the state tensors a real step
    leaves (Muon's momentum on the hidden matrices, AdamW's two moments on the rest), and are fewer than
    AdamW's two per parameter; with LoRA every adapter is a hidden matrix."""
    from transformers import AutoModelForCausalLM

    from rlhf_plugins.models.memory import MemoryInputs, ModelShape, torch_learner_memory

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    named = list(model.named_parameters())
    opt = MuonWithAdamW(named, settings(), 1e-3)
    fake_grads(named, seed=3)
    opt.step()
    real = sum(t.numel() for state in opt.state.values() for k, t in state.items() if k != "step")
    shape = ModelShape.of_folder(tiny_model)
    config, _, _ = prepare({"learner": {"optimizer": "muon"}, "model": {"dtype": "float32"}}, autoload=False)
    items = torch_learner_memory(MemoryInputs(config, shape, "actor", 1, shape.parameters, 0, 0))
    assert items["optimizer states"] == 4 * real
    assert 4 * shape.parameters < items["optimizer states"] < 4 * 2 * shape.parameters
    adapters = torch_learner_memory(MemoryInputs(config, shape, "actor", 1, 1000, 0, 0))
    assert adapters["optimizer states"] == 4 * 1000


@needs_muon
def test_a_step_is_torchs_muon_and_adamw_run_apart_and_the_schedule_scales_both(tiny_model):
    from transformers import AutoModelForCausalLM

    from rlhf_plugins.learners.base import make_scheduler

    cfg = settings()
    ours_model = AutoModelForCausalLM.from_pretrained(tiny_model)
    apart_model = copy.deepcopy(ours_model)
    ours_named, apart_named = list(ours_model.named_parameters()), list(apart_model.named_parameters())
    ours = MuonWithAdamW(ours_named, cfg, 1e-3)
    config, _, _ = prepare({"learner": {"optimizer": "muon", "lr_scheduler": "linear"}, "train": {"steps": 4}},
                           autoload=False)
    schedule = make_scheduler(ours, config, config.learner)
    muon = torch.optim.Muon([p for n, p in apart_named if uses_muon(n, p)], lr=0.02, weight_decay=0.01,
                            momentum=0.95, nesterov=True, ns_steps=5)
    adamw = torch.optim.AdamW([p for n, p in apart_named if not uses_muon(n, p)], lr=1e-3, weight_decay=0.01,
                              betas=tuple(cfg.betas), eps=cfg.eps)
    for seed in (1, 2):
        fake_grads(ours_named, seed)
        fake_grads(apart_named, seed)
        factor = schedule.get_last_lr()[0] / 1e-3
        for group, lr in ((muon.param_groups[0], 0.02), (adamw.param_groups[0], 1e-3)):
            group["lr"] = lr * factor
        ours.step()
        schedule.step()
        muon.step()
        adamw.step()
    assert factor < 1  # the second step ran at a decayed rate on both halves
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(ours_named, apart_named))


@needs_muon
def test_the_muon_update_is_orthogonalised(tiny_model):
    """No momentum, no decay: a hidden matrix moves by lr x scale x NS(gradient), whose singular values
    Newton-Schulz's quintic puts near 1 (about 0.7 to 1.2) however spread the gradient's are."""
    from transformers import AutoModelForCausalLM

    named = list(AutoModelForCausalLM.from_pretrained(tiny_model).named_parameters())
    opt = MuonWithAdamW(named, settings(muon_momentum=0.0, muon_nesterov=False, weight_decay=0.0, muon_lr=1.0), 1e-3)
    fake_grads(named, 3)
    name, p = next((n, p) for n, p in named if n.endswith("mlp.down_proj.weight"))
    before, grad = p.detach().clone(), p.grad.clone()
    opt.step()
    update = (before - p.detach()) / max(1.0, p.shape[0] / p.shape[1]) ** 0.5  # torch's "original" scale
    s_update, s_grad = torch.linalg.svdvals(update), torch.linalg.svdvals(grad)
    assert float(s_grad.max() / s_grad.min()) > 5
    assert 0.6 < float(s_update.min()) and float(s_update.max()) < 1.25, (name, s_update)


@needs_muon
def test_the_optimizer_resumes_exactly(tmp_path):
    first = torch_learner("float32", optimizer="muon")
    objective = Objective(policy_losses.ppo, prepare({}, autoload=False)[0].algo.policy_loss)
    first.train(ppo_batch(1), objective)
    first.save_checkpoint(str(tmp_path / "ckpt"))
    first.train(ppo_batch(2), objective)
    second = torch_learner("float32", optimizer="muon")
    second.load_checkpoint(str(tmp_path / "ckpt"))
    assert isinstance(second.optimizer, MuonWithAdamW) and second.optimizer.parts[1].state is second.optimizer.state
    second.train(ppo_batch(2), objective)
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(first.named_weights(), second.named_weights()))


@needs_muon
def test_a_run_with_muon(rlhf):
    code, _, err = rlhf("train", "--learner.optimizer", "muon", *short_run())
    assert code == 0, err
    rows = metrics_of(the_run())
    assert all(r["lr"] == pytest.approx(prepare({}, autoload=False)[0].learner.lr) for r in rows)
    assert all(r["grad_norm"] > 0 for r in rows)


def test_openrlhf_flags_map_to_muon():
    from rlhf_plugins.commands.convert import convert

    conv = convert(["python3", "-m", "openrlhf.cli.train_ppo_ray", "--optim", "muon", "--muon.lr", "0.01",
                    "--muon.momentum", "0.9", "--muon.no_nesterov", "--critic.muon.ns_steps", "3"])
    raw = conv.raw
    assert raw["learner"]["optimizer"] == "muon" and raw["learner"]["muon_lr"] == 0.01
    assert raw["learner"]["muon_momentum"] == 0.9
    # placeholders in OpenRLHF (its DeepSpeed's Muon runs 5 steps with Nesterov): listed, not carried
    assert "muon_nesterov" not in raw["learner"] and "muon_ns_steps" not in raw.get("critic", {})
    assert {flag for flag, why in conv.skipped if "placeholder" in why} == {"--muon.no_nesterov", "--critic.muon.ns_steps"}


@pytest.mark.integration
def test_deepspeed_zero3_runs_its_own_muon_over_two_ranks(local_ray, tiny_model):
    """DeepSpeed's Muon on two ZeRO-3 ranks: the tensors it tags for Muon are ours, and one step moves
    a hidden matrix by an orthogonalised update and an embedding by an AdamW one (about lr)."""
    pytest.importorskip("deepspeed")
    from rlhf_plugins import PlacementContext
    from rlhf_plugins.placement.ray_placement import RayPlacement
    from rlhf_plugins.training.roles import PolicyRole

    config, pm, plan = prepare({"placement": {"strategy": "ray"}, "ray": {"actor_workers": 2},
                                "learner": {"backend": "deepspeed", "optimizer": "muon", "lr": 1e-3, "muon_lr": 0.02,
                                            "weight_decay": 0.0},
                                "deepspeed": {"zero_stage": 3}, "train": {"prompts_per_step": 4},
                                "generation": {"n_samples_per_prompt": 4}}, autoload=False)
    objective = Objective(policy_losses.ppo, config.algo.policy_loss)
    placement = RayPlacement(PlacementContext(config, ("actor",), plugin_spec=pm.spec))
    try:
        group = placement.create_role("actor", PolicyRole, config, pm.spec, tiny_model, plan.learner)
        before = {k: v.clone() for k, v in group.named_weights()}
        # DeepSpeed compiles its Newton-Schulz steps with inductor: minutes of C++ builds on two CPU cores,
        # for the same numbers eagerly
        group.run(lambda ctx: setattr(__import__("torch")._dynamo.config, "disable", True))
        tagged = group.run(lambda ctx: {n: bool(p.use_muon) for n, p in ctx.backend.model.named_parameters()})
        batch = random_batch(group=4, prompts=4, seed=5)
        batch["advantages"] = torch.randn(batch["action_mask"].shape, generator=torch.Generator().manual_seed(1))
        group.train(batch, objective)
        after = dict(group.named_weights())
    finally:
        placement.shutdown()
    assert tagged[0] == tagged[1] == {n: uses_muon(n, before[n]) for n in before}
    down = next(n for n in before if n.endswith("mlp.down_proj.weight"))
    s = torch.linalg.svdvals((after[down] - before[down]).float())
    # orthogonalised: most directions move by about the same step (a gradient's singular values decay fast)
    assert float(s[15]) > 0.5 * float(s[0]), s  # sorted: 16 directions within a factor 2 of the largest
    embed = float((after["model.embed_tokens.weight"] - before["model.embed_tokens.weight"]).abs().max())
    assert 0.2e-3 < embed < 3e-3


def test_a_torch_without_muon_is_one_line(rlhf, monkeypatch):
    monkeypatch.delattr(torch.optim, "Muon", raising=False)
    code, _, err = rlhf("train", "--learner.optimizer", "muon", *short_run())
    assert code == 2 and err.strip().count("\n") == 0
    assert f"learner.optimizer muon needs torch.optim.Muon (torch 2.9 or newer); this is torch {torch.__version__}" in err


@needs_muon
def test_openrlhf_critic_muon_flags_reach_the_critics_own_optimizer(tiny_model):
    """0.11's --critic.muon.* set the critic's Muon, --actor.muon.* the actor's alone (the critic keeps
    OpenRLHF's default, whatever the order), 0.10's flat --muon.* both: each learner's torch.optim.Muon
    steps with its own lr and momentum, and the critic's own Nesterov switch and Newton-Schulz steps."""
    from rlhf_plugins.commands.convert import convert
    from rlhf_plugins.learners.torch_learner import TorchLearner
    from rlhf_plugins.testing import backend_context

    raw = convert(["python3", "-m", "openrlhf.cli.train_ppo_ray", "--optim", "muon",
                   "--critic.muon.momentum", "0.8", "--muon.lr", "0.03", "--actor.muon.momentum", "0.9",
                   "--critic.muon.lr", "0.05"]).raw
    raw["learner"]["backend"] = "torch"  # whose Muon takes Newton-Schulz steps and Nesterov (DeepSpeed's fixes them)
    raw["critic"].update(muon_nesterov=False, muon_ns_steps=3)
    config, pm, _ = prepare({k: raw[k] for k in ("learner", "critic")} | {"model": {"dtype": "float32"}},
                            autoload=False)

    def muon_group(role: str) -> dict:
        learner = TorchLearner(backend_context(config, role, tiny_model, pm))
        muon = [part for part in learner.optimizer.parts if isinstance(part, torch.optim.Muon)]
        assert len(muon) == 1
        return muon[0].param_groups[0]

    actor, critic = muon_group("actor"), muon_group("critic")  # initial_lr: the schedule warms lr up from it
    assert (actor["initial_lr"], actor["momentum"], actor["nesterov"], actor["ns_steps"]) == (0.03, 0.9, True, 5)
    assert (critic["initial_lr"], critic["momentum"], critic["nesterov"], critic["ns_steps"]) == (0.05, 0.8, False, 3)
    flat = convert(["python3", "-m", "openrlhf.cli.train_ppo_ray", "--optim", "muon", "--muon.momentum", "0.7"]).raw
    assert flat["learner"]["muon_momentum"] == 0.7 and "muon_momentum" not in flat.get("critic", {})  # both's
