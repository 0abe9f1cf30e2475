"""A real two-node Ray cluster on one machine (each node with its own CPUs and fake GPUs)."""
from __future__ import annotations

import math
import os

import pytest
import torch

ray = pytest.importorskip("ray")
pytest.importorskip("deepspeed")
pytestmark = pytest.mark.integration

from rlhf_plugins import PlacementContext  # noqa: E402
from rlhf_plugins.algorithms import policy_losses  # noqa: E402
from rlhf_plugins.algorithms.objective import Objective  # noqa: E402
from rlhf_plugins.api import prepare  # noqa: E402
from rlhf_plugins.placement.ray_cluster import loopback_only  # noqa: E402
from rlhf_plugins.placement.ray_placement import RayPlacement  # noqa: E402
from rlhf_plugins.training.roles import PolicyRole  # noqa: E402
from tests.helpers import random_batch  # noqa: E402


@pytest.fixture(scope="module")
def two_nodes():
    from ray.cluster_utils import Cluster

    os.environ["RAY_AUTH_MODE"] = "disabled"
    if ray.is_initialized():
        ray.shutdown()
    loopback_only()  # every node of the test cluster on 127.0.0.1
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 3, "num_gpus": 2})
    cluster.add_node(num_cpus=3, num_gpus=2)
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def config(**ray_opts):
    config, pm, plan = prepare({
        "placement": {"strategy": "ray"},
        "learner": {"backend": "deepspeed"}, "deepspeed": {"zero_stage": 2},
        "ray": {"ready_timeout": 20, **ray_opts},
        "train": {"prompts_per_step": 4},
        "generation": {"n_samples_per_prompt": 4},
    }, autoload=False)
    return config, pm, plan


def nodes_of(pg):
    return list(ray.util.placement_group_table(pg)["bundles_to_node_id"].values())


def test_pack_prefers_one_node_and_strict_spread_uses_two(two_nodes):
    for strategy, expected in (("PACK", 1), ("STRICT_SPREAD", 2), ("STRICT_PACK", 1)):
        cfg, _, _ = config(strategy=strategy, actor_workers=2)
        p = RayPlacement(PlacementContext(cfg, ("actor",)))
        try:
            assert len(set(nodes_of(p.pgs["actor"]))) == expected, strategy
        finally:
            p.shutdown()


def test_actor_group_across_nodes_trains_a_step(two_nodes, tiny_model):
    cfg, pm, plan = config(strategy="STRICT_SPREAD", actor_workers=2)
    p = RayPlacement(PlacementContext(cfg, ("actor",), plugin_spec=pm.spec))
    try:
        group = p.create_role("actor", PolicyRole, cfg, pm.spec, tiny_model, plan.learner)
        infos = group.env_info()
        assert infos[0]["node_id"] != infos[1]["node_id"]
        assert [i["RANK"] for i in infos] == ["0", "1"] and all(i["dist_initialized"] for i in infos)
        batch = random_batch(group=4, prompts=4, seed=2)
        batch["advantages"] = torch.randn(batch["action_mask"].shape) * batch["action_mask"]
        before = dict(group.named_weights())
        metrics = group.train(batch, Objective(policy_losses.ppo, cfg.algo.policy_loss))
        after = dict(group.named_weights())
        assert metrics["grad_norm"] > 0 and math.isfinite(metrics["loss/policy"])
        assert any(not torch.equal(before[k], after[k]) for k in before)
    finally:
        p.shutdown()


def test_a_run_starts_its_own_local_cluster_while_another_runs_on_this_machine(two_nodes, tmp_path):
    """Ray's ray.init() without an address joins the cluster last started on this machine (here the
    two-node test cluster, which records itself in /tmp/ray/ray_current_cluster) and then refuses the
    resources asked for; `rlhf train` without --ray.address asks for a local cluster of its own."""
    from tests.helpers import run_subprocess, short_run

    proc = run_subprocess("train", "--placement.strategy", "ray", "--ray.local_num_gpus", "4",
                          *short_run("--train.steps", "1"), cwd=tmp_path, env={"RLHF_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(ray.nodes()) == 2 and ray.cluster_resources().get("GPU") == 4  # the test cluster, untouched
