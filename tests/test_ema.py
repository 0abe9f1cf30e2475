"""The moving average of the actor's weights (--learner.ema / --learner.ema_beta, OpenRLHF's
--enable_ema / --ema_beta): the recursion on random tensors, every learner's average after real
updates against the same recursion over its weights, the final model saved from it (the weights
left as they were), ZeRO-3 partitions over two Ray ranks, exact resume, the OpenRLHF flags and the
memory plan."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from rlhf_plugins.algorithms import policy_losses
from rlhf_plugins.algorithms.objective import Objective
from rlhf_plugins.api import prepare
from rlhf_plugins.testing import backend_context
from tests.helpers import in_process_trainer, metrics_of, ppo_batch, ppo_update, short_run, the_run, torch_learner

BETA = 0.6


def averaged(history: list[dict[str, torch.Tensor]], beta: float = BETA) -> dict[str, torch.Tensor]:
    """The average of a run of weights by its definition, in float64: the first is where it starts."""
    out = {k: v.double() for k, v in history[0].items()}
    for weights in history[1:]:
        out = {k: beta * out[k] + (1 - beta) * weights[k].double() for k in out}
    return out


def saved_model(folder) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_average_follows_its_recursion_and_a_swap_gives_the_weights_back(dtype):
    """float32 weights (one multi-tensor update) and bfloat16 ones (widened one at a time): the
    average, kept in float32, follows the recursion over the weights as they were."""
    from rlhf_plugins.learners.ema import WeightAverage

    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(5, 3, generator=g).to(dtype), torch.randn(7, generator=g).to(dtype)]
    average = WeightAverage(weights, BETA)
    history = [{i: w.clone() for i, w in enumerate(weights)}]
    for _ in range(4):
        for w in weights:
            w.add_(torch.randn(w.shape, generator=g).to(dtype))
        average.update()
        history.append({i: w.clone() for i, w in enumerate(weights)})
    want = averaged(history)
    assert all(a.dtype == torch.float32 for a in average.average)
    for i, a in enumerate(average.average):
        torch.testing.assert_close(a.double(), want[i], rtol=0, atol=1e-6)
    seen = average.swapped_in(lambda: [w.clone() for w in weights])
    assert all(torch.equal(s, a.to(dtype)) for s, a in zip(seen, average.average))  # the save saw the average
    assert all(torch.equal(w, history[-1][i]) for i, w in enumerate(weights))  # and the weights came back


def _learner(backend: str, dtype: str, tiny_model: str):
    if backend == "torch":
        return torch_learner(dtype, ema=True, ema_beta=BETA)
    from rlhf_plugins.learners.fsdp_learner import FSDPLearner

    config, pm, _ = prepare({"model": {"dtype": dtype}, "learner": {"backend": "fsdp", "lr": 1e-3, "ema": True,
                                                                   "ema_beta": BETA},
                             "train": {"prompts_per_step": 3}, "generation": {"n_samples_per_prompt": 4}},
                            autoload=False)
    return FSDPLearner(backend_context(config, "actor", tiny_model, pm))


@pytest.mark.parametrize("backend, dtype, tol", [("torch", "float32", 1e-6), ("torch", "bfloat16", 2e-2),
                                                 ("fsdp", "float32", 1e-6)])
def test_a_learners_final_model_is_the_average_of_its_weights(backend, dtype, tol, tiny_model, tmp_path):
    """Three updates at lr 1e-3: the saved model equals the recursion over the weights after each
    update (bf16: over the float32 masters the learner averages, read back through 16 bits), and the
    learner's own weights are untouched by the save."""
    learner = _learner(backend, dtype, tiny_model)
    history = [{k: v.clone() for k, v in learner.named_weights()}]
    masters = getattr(learner, "masters", None)
    exact = [[m.detach().clone() for m in masters.masters]] if masters is not None else None
    for seed in (1, 2, 3):
        ppo_update(learner, ppo_batch(seed))
        history.append({k: v.clone() for k, v in learner.named_weights()})
        if exact is not None:
            exact.append([m.detach().clone() for m in masters.masters])
    learner.save_average(str(tmp_path / "final"))
    got = saved_model(tmp_path / "final")
    want = averaged(history)
    moved = max(float((want[k] - history[-1][k].double()).abs().max()) for k in want)
    assert moved > 1e-3  # the average lags the weights: the comparison below can tell them apart
    for name, value in want.items():
        torch.testing.assert_close(got[name].double(), value, rtol=0, atol=tol)
    if exact is not None:  # the average itself, against its float32 sources
        want_exact = averaged([dict(enumerate(step)) for step in exact])
        for i, a in enumerate(learner.average.average):
            torch.testing.assert_close(a.double(), want_exact[i], rtol=0, atol=1e-6)
    assert all(torch.equal(v, history[-1][k]) for k, v in learner.named_weights())


def test_resuming_continues_the_average_exactly(tmp_path):
    first = torch_learner("float32", ema=True, ema_beta=BETA)
    for seed in (1, 2):
        ppo_update(first, ppo_batch(seed))
    first.save_checkpoint(str(tmp_path / "ckpt"))
    ppo_update(first, ppo_batch(3))
    second = torch_learner("float32", ema=True, ema_beta=BETA)
    second.load_checkpoint(str(tmp_path / "ckpt"))
    ppo_update(second, ppo_batch(3))
    assert all(torch.equal(a, b) for a, b in zip(first.average.average, second.average.average))


def test_a_run_saves_the_average_as_its_final_model(rlhf):
    code, out, err = rlhf("train", *short_run(), "--learner.ema", "true", "--learner.ema_beta", "0.5",
                          "--learner.lr", "5e-3")
    assert code == 0, err
    run = the_run()
    final = saved_model(run / "final")
    last = saved_model(run / "checkpoints" / sorted(p.name for p in (run / "checkpoints").iterdir())[-1] / "actor")
    assert final.keys() <= last.keys() and len(metrics_of(run)) == 3
    assert any(not torch.equal(final[k], last[k].to(final[k].dtype)) for k in final)  # not the last weights


def test_the_best_policy_is_kept_as_evaluated_not_averaged(tiny_model, tmp_path, monkeypatch):
    """An evaluation that is the best so far keeps the policy it evaluated in best/ (the weights the
    engine sampled with), while final/ holds the average."""
    from rich.console import Console

    from rlhf_plugins.training.heldout import make_evaluator, run_eval
    from rlhf_plugins.training.runlog import MetricsLog

    monkeypatch.chdir(tmp_path)
    t = in_process_trainer(tiny_model, {"train": {"prompts_per_step": 4, "steps": 2, "best_metric": "eval/pass@1"},
                                        "generation": {"n_samples_per_prompt": 4}, "eval": {"n_samples": 2},
                                        "learner": {"lr": 5e-3, "ema": True, "ema_beta": 0.5}})
    try:
        t.evaluator = make_evaluator(t.config, t.pm, t.tokenizer, t.engine, t.reward, t.prompts.head(8))
        for step in range(2):
            t.step(step)
        t.best = {"metric": "eval/pass@1", "value": -1.0, "step": 0}  # any evaluation now improves on it
        run_eval(t, tmp_path, MetricsLog(tmp_path), Console(quiet=True))
        t.save_final(tmp_path / "final")
        policy = t.actor.run(lambda ctx: dict(ctx.backend.named_weights()), rank=0)
    finally:
        t.shutdown()
    best, final = saved_model(tmp_path / "best"), saved_model(tmp_path / "final")
    assert json.loads((tmp_path / "best.json").read_text())["step"] == 2
    assert all(torch.equal(best[k], p) for k, p in policy.items())
    assert any(not torch.equal(final[k], p) for k, p in policy.items())


@pytest.mark.integration
def test_zero3_ranks_average_their_partitions_and_save_the_whole_average(local_ray, tiny_model, tmp_path):
    pytest.importorskip("deepspeed")
    from rlhf_plugins import PlacementContext
    from rlhf_plugins.placement.ray_placement import RayPlacement
    from rlhf_plugins.training.roles import PolicyRole

    config, pm, plan = prepare({"placement": {"strategy": "ray"}, "learner": {"backend": "deepspeed", "lr": 1e-3,
                                                                                "ema": True, "ema_beta": BETA},
                                "deepspeed": {"zero_stage": 3}, "ray": {"actor_workers": 2},
                                "train": {"prompts_per_step": 4}, "generation": {"n_samples_per_prompt": 4}},
                               autoload=False)
    objective = Objective(policy_losses.ppo, config.algo.policy_loss)
    placement = RayPlacement(PlacementContext(config, ("actor",), plugin_spec=pm.spec))
    try:
        group = placement.create_role("actor", PolicyRole, config, pm.spec, tiny_model, plan.learner)
        history = [dict(group.named_weights())]
        for seed in (1, 2):
            group.train(ppo_batch(seed), objective)
            history.append(dict(group.named_weights()))
        group.save_average(str(tmp_path / "final"))
        after = dict(group.named_weights())
    finally:
        placement.shutdown()
    got, want = saved_model(tmp_path / "final"), averaged(history)
    assert max(float((want[k] - history[-1][k].double()).abs().max()) for k in want) > 1e-4  # it lags
    for name, value in want.items():
        torch.testing.assert_close(got[name].double(), value, rtol=0, atol=1e-6)
    assert all(torch.equal(after[k], history[-1][k]) for k in after)


def test_the_openrlhf_flags_and_the_memory_plan(tiny_model):
    from rlhf_plugins.commands.convert import convert

    raw = convert(["python", "-m", "openrlhf.cli.train_ppo_ray", "--enable_ema", "--ema_beta", "0.99"]).raw
    assert raw["learner"]["ema"] is True and raw["learner"]["ema_beta"] == 0.99
    from rlhf_plugins.models.memory import MemoryInputs, ModelShape, torch_learner_memory

    config, _, _ = prepare({"learner": {"ema": True}}, autoload=False)
    shape = ModelShape.of_folder(tiny_model)
    need = torch_learner_memory(MemoryInputs(config, shape, "actor", 1, shape.parameters, 64, 0))
    assert need["weight average"] == 4 * shape.parameters
    assert "weight average" not in torch_learner_memory(MemoryInputs(config, shape, "critic", 1, shape.parameters,
                                                                     64, 0))
