"""Ray placement on a local cluster with fake GPUs: layouts, placement, ranks, DeepSpeed."""
from __future__ import annotations

import time

import pytest
import torch

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.integration

import sys  # noqa: E402

from rlhf_plugins import PlacementContext  # noqa: E402
from rlhf_plugins.builtin_plugins.placement_ray import RayOptions  # noqa: E402
from rlhf_plugins.config.loading import build_config  # noqa: E402
from rlhf_plugins.config.options import OptionRegistry  # noqa: E402
from rlhf_plugins.placement.ray_cluster import ClusterError  # noqa: E402
from rlhf_plugins.placement.ray_placement import RayPlacement  # noqa: E402

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers get Probe by value


def config(**ray_opts):
    options = OptionRegistry()
    options.add_section("ray", RayOptions)
    raw = {"placement": {"strategy": "ray"}, "ray": {"ready_timeout": 5, **ray_opts}}
    return build_config(raw, options)


class Probe:
    """A role without a model: reports its environment, forms a gloo group on demand."""

    def __init__(self, tag: str) -> None:
        self.tag = tag

    def all_reduce(self, value: float) -> float:
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo")
        t = torch.tensor([value])
        dist.all_reduce(t)
        return float(t)


def bundles_of(pg):
    table = ray.util.placement_group_table(pg)
    return table["strategy"], list(table["bundles"].values())


@pytest.mark.parametrize("strategy", ["PACK", "STRICT_PACK", "SPREAD"])
def test_one_placement_group_per_role(local_ray, strategy):
    p = RayPlacement(PlacementContext(config(strategy=strategy, actor_workers=2), ("generation", "actor", "reference", "reward")))
    try:
        assert set(p.pgs) == {"generation", "actor", "reference", "reward"}
        got_strategy, bundles = bundles_of(p.pgs["actor"])
        assert got_strategy == strategy
        assert bundles == [{"GPU": 1.0, "CPU": 1.0}, {"GPU": 1.0, "CPU": 1.0}]
        assert bundles_of(p.pgs["reward"])[1] == [{"CPU": 1.0}]  # rule rewards take no GPU
    finally:
        p.shutdown()


@pytest.mark.parametrize(
    "mode, groups, share",
    [
        ("actor_ref", {"actor+reference", "generation", "reward"}, {"GPU": 0.5, "CPU": 0.5}),
        ("critic_reward", {"actor", "generation", "reference", "critic+reward"}, {"GPU": 1.0, "CPU": 1.0}),
        ("all", {"actor+reference+critic+reward+generation"}, {"GPU": 0.2, "CPU": 0.2}),
    ],
)
def test_colocation_modes_share_bundles(local_ray, mode, groups, share):
    roles = ("generation", "actor", "reference", "critic", "reward") if mode != "actor_ref" else \
        ("generation", "actor", "reference", "reward")
    p = RayPlacement(PlacementContext(config(colocate=mode), roles))
    try:
        assert set(p.pgs) == groups
        actor = p.create_role("actor", Probe, "a")
        info = actor.env_info()[0]
        assert info["resources"] == share
        key = next(k for k in p.pgs if "actor" in k.split("+"))
        assert info["placement_group_id"] == p.pgs[key].id.hex()
        if mode == "all":
            gen = p.create_role("generation", Probe, "g")
            assert gen.env_info()[0]["placement_group_id"] == info["placement_group_id"]
    finally:
        p.shutdown()


def test_rank_environment_and_process_group(local_ray):
    p = RayPlacement(PlacementContext(config(actor_workers=2), ("actor",)))
    try:
        group = p.create_role("actor", Probe, "x")
        infos = group.env_info()
        assert [i["RANK"] for i in infos] == ["0", "1"]
        assert {i["WORLD_SIZE"] for i in infos} == {"2"}
        assert len({(i["MASTER_ADDR"], i["MASTER_PORT"]) for i in infos}) == 1
        # one GPU visible per actor: Ray sets CUDA_VISIBLE_DEVICES, LOCAL_RANK is 0
        assert all(i["CUDA_VISIBLE_DEVICES"] == i["gpu_ids"][0] for i in infos)
        assert [i["LOCAL_RANK"] for i in infos] == ["0", "0"]
        # the ranks form a gloo group: every rank sees the sum
        refs = [w.call.remote("all_reduce", (float(r + 1),), {}) for r, w in enumerate(group.workers)]
        assert ray.get(refs) == [3.0, 3.0]
    finally:
        p.shutdown()


def test_noset_visible_devices_is_honoured(local_ray, monkeypatch):
    monkeypatch.setenv("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES", "1")
    p = RayPlacement(PlacementContext(config(actor_workers=2), ("actor",)))
    try:
        infos = p.create_role("actor", Probe, "x").env_info()
        # Ray leaves *_VISIBLE_DEVICES alone; the rank addresses its GPU by id
        assert [i["LOCAL_RANK"] for i in infos] == [i["gpu_ids"][0] for i in infos]
        assert all(i["CUDA_VISIBLE_DEVICES"] in (None, "") or "," in i["CUDA_VISIBLE_DEVICES"] for i in infos)
    finally:
        p.shutdown()


class Gathering:
    """A role whose construction waits until ``expected`` ranks of the test's roles are being
    constructed (a file per rank in ``where``): a placement that starts roles one after another
    never gets past the first."""

    def __init__(self, where: str, tag: str, expected: int, fail: bool = False) -> None:
        import os
        from pathlib import Path

        from rlhf_plugins.errors import UsageError

        tag = f"{tag}-{os.environ['RANK']}"
        Path(where, tag).touch()
        deadline = time.monotonic() + 60
        while len(list(Path(where).iterdir())) < expected:
            if time.monotonic() > deadline:
                raise RuntimeError(f"role {tag}: the other roles never started beside it")
            time.sleep(0.05)
        if fail:
            raise UsageError(f"role {tag} refuses its config")
        self.tag = tag

    def name(self) -> str:
        return self.tag


def test_roles_start_concurrently(local_ray, tmp_path):
    roles = ("generation", "actor", "reference")
    p = RayPlacement(PlacementContext(config(actor_workers=2), roles))
    try:
        # 4 actors in all (2 actor ranks): each is constructed only once all four are under way
        groups = {r: p.create_role(r, Gathering, str(tmp_path), r, 4) for r in roles}
        p.ready()
        assert {r: g.name() for r, g in groups.items()} == {"generation": "generation-0", "actor": "actor-0",
                                                             "reference": "reference-0"}
        assert sorted(f.name for f in tmp_path.iterdir()) == ["actor-0", "actor-1", "generation-0", "reference-0"]
    finally:
        p.shutdown()


def test_a_role_failing_at_start_stops_set_up_and_leaves_no_actor(local_ray, tmp_path):
    from rlhf_plugins.errors import UsageError

    p = RayPlacement(PlacementContext(config(), ("generation", "actor", "reference")))
    try:
        p.create_role("generation", Gathering, str(tmp_path), "generation", 3)
        p.create_role("actor", Gathering, str(tmp_path), "actor", 3, fail=True)
        p.create_role("reference", Gathering, str(tmp_path), "reference", 3)
        with pytest.raises(UsageError, match="role actor-0 refuses its config"):
            p.ready()
        assert sorted(f.name for f in tmp_path.iterdir()) == ["actor-0", "generation-0", "reference-0"]
    finally:
        p.shutdown()
    alive = [a for a in ray.util.list_named_actors() if a.startswith(f"rlhf-{p.run_id}-")]
    assert alive == []


class Stopper:
    """A role that can be kept busy, and that leaves a file when asked to stop."""

    def __init__(self, where: str, tag: str) -> None:
        self.where, self.tag = where, tag

    def busy(self, seconds: float) -> None:
        time.sleep(seconds)

    def shutdown(self) -> None:
        from pathlib import Path

        Path(self.where, f"{self.tag}-stopped").touch()


def test_a_role_whose_call_timed_out_is_killed_without_waiting_for_it_to_stop(local_ray, tmp_path, monkeypatch):
    """The run ends after a call did not return: the other roles are asked to stop (and do), the
    hung one is not asked (it could not answer: the shutdown would wait out its deadline on it) and
    is killed."""
    from rlhf_plugins.errors import RoleCallTimeout
    from rlhf_plugins.placement import ray_placement

    monkeypatch.setattr(ray_placement, "SHUTDOWN_SECONDS", 5.0)  # a regression fails in seconds
    # a start waits up to the ready timeout (config's 5 s: one CI run's loaded 2-core machine took longer
    # to start a role's process); the call under test is bounded by call_timeout alone
    p = RayPlacement(PlacementContext(config(call_timeout=1, ready_timeout=120), ("actor", "reference")))
    waits, real_wait = [], ray.wait

    def watched_wait(refs, **kwargs):  # the shutdown's wait: how many stops it asked for, how many came
        ready, pending = real_wait(refs, **kwargs)
        waits.append((len(refs), len(ready)))
        return ready, pending

    try:
        groups = {r: p.create_role(r, Stopper, str(tmp_path), r) for r in ("actor", "reference")}
        p.ready()
        with pytest.raises(RoleCallTimeout, match="role 'actor' \\(rank 0\\) in 'busy' did not return within 1 s"):
            groups["actor"].busy(600)
        groups["reference"].busy(0)
    finally:
        monkeypatch.setattr(ray, "wait", watched_wait)
        p.shutdown()
    assert waits == [(1, 1)]  # the reference alone was asked to stop, and it answered
    assert sorted(f.name for f in tmp_path.iterdir()) == ["reference-stopped"]
    assert [a for a in ray.util.list_named_actors() if a.startswith(f"rlhf-{p.run_id}-")] == []


def test_a_restart_starts_each_worker_only_once_ray_has_let_go_of_its_old_name(local_ray, tmp_path, monkeypatch):
    """``ray.kill`` returns before the cluster forgets the actor, and a worker restarted at once under its
    name failed to start (ActorAlreadyExistsError, seen in CI on a loaded machine). Here the cluster lets go
    of a killed worker a second late, as there: after one of two ranks dies, both are started again only when
    neither old name is held, and answer; a name still held past the wait is one line."""
    import threading

    from rlhf_plugins.errors import RoleFailed

    p = RayPlacement(PlacementContext(config(actor_workers=2, max_restarts=1, ready_timeout=120), ("actor",)))
    held_at_start, spawn = [], p._spawn

    def watched_spawn(*args, **kwargs):
        held_at_start.append(set(ray.util.list_named_actors()))
        return spawn(*args, **kwargs)

    try:
        handle = p.create_role("actor", Stopper, str(tmp_path), "actor")
        p.ready()
        old = list(p.groups["actor"].workers)
        ray.kill(old[1])  # rank 1 dies (and is gone before the run looks: ray.kill returns before)
        p.await_released([p.actor_name("actor", 1)])
        p._spawn = watched_spawn
        with monkeypatch.context() as slow:  # the kill takes effect a second after ray.kill returns
            kill = ray.kill
            slow.setattr(ray, "kill", lambda actor, **kw: threading.Timer(1.0, kill, (actor,), kw).start())
            assert p.recover() == ["actor"]
        names = {p.actor_name("actor", 0), p.actor_name("actor", 1)}
        assert len(held_at_start) == 1 and not names & held_at_start[0]  # both old names gone before the start
        assert names <= set(ray.util.list_named_actors()) and p.groups["actor"].workers != old
        handle.busy(0)  # both new ranks answer
        with pytest.raises(RoleFailed, match=r"Ray still holds the workers rlhf-\w+-actor-0 0.2 s after they were "
                                             r"killed; the run cannot restart them under their names"):
            p.await_released([p.actor_name("actor", 0)], timeout=0.2)
    finally:
        p.shutdown()


def test_more_gpus_than_the_cluster_fails_at_once(local_ray):
    """Decided from the cluster's resources: no placement group is asked for (none would ever be ready)."""
    groups = len(ray.util.placement_group_table())
    with pytest.raises(ClusterError, match=r"the roles ask for 6 GPU in all \(actor 6\) but the cluster has 4: 1 node\(s\)"):
        RayPlacement(PlacementContext(config(actor_workers=6, ready_timeout=3600), ("actor",)))
    assert len(ray.util.placement_group_table()) == groups


def test_strict_spread_on_one_node_times_out_with_a_reason(local_ray):
    with pytest.raises(ClusterError, match=r"STRICT_SPREAD needs one node per bundle.*not ready after \d+ s"):
        RayPlacement(PlacementContext(config(actor_workers=2, strategy="STRICT_SPREAD", ready_timeout=2), ("actor",)))
    # nothing is left reserved: a feasible request still fits
    p = RayPlacement(PlacementContext(config(actor_workers=4), ("actor",)))
    p.shutdown()


def _fails_to_compile() -> None:
    """What a role's torch.compile raises when g++ fails on a kernel."""
    from tests.helpers import raise_cpp_compile_error

    raise_cpp_compile_error("k.cpp:1:2: error: 'at::vec' has not been declared")


def test_a_role_whose_compile_failed_is_named_in_the_one_line_error(local_ray):
    """A role's compile error reaches the driver inside Ray's RayTaskError: the call's description gives it
    the role, so the run's one line names it as it does for a role in this process."""
    from rlhf_plugins.placement.ray_roles import get
    from rlhf_plugins.training.compile_failure import explain, is_compile_failure

    with pytest.raises(ray.exceptions.RayTaskError) as raised:
        get(ray.remote(_fails_to_compile).remote(), "role 'critic' rank 1 in 'update'", timeout=60)
    assert is_compile_failure(raised.value)
    assert str(explain(raised.value)).startswith(
        "torch.compile failed in role 'critic' -- CppCompileError: C++ compile error ('at::vec' has not been declared); "
        "if a run was killed while compiling"), str(explain(raised.value))


@pytest.mark.timeout(120)  # a hang fails here instead of stalling the suite
def test_unreachable_address_is_bounded():
    from rlhf_plugins.placement.ray_cluster import connect

    opts = RayOptions(address="127.0.0.1:1", connect_timeout=2)
    with pytest.raises(ClusterError, match="cannot reach the Ray cluster at '127.0.0.1:1'"):
        if ray.is_initialized():
            ray.shutdown()
        connect(opts)


def test_a_local_cluster_the_run_starts_listens_on_loopback():
    """The cluster ``rlhf train`` starts for itself binds 127.0.0.1, not the machine's network address
    (in a fresh process: Ray reads the setting when it is imported)."""
    import subprocess

    from tests.helpers import clean_env

    code = ("from rlhf_plugins.api import prepare\n"
            "from rlhf_plugins.placement.ray_cluster import connect\n"
            "config, _, _ = prepare({'placement': {'strategy': 'ray'}, 'ray': {'local_num_cpus': 2}}, autoload=False)\n"
            "assert connect(config.section('ray'))\n"
            "import ray\n"
            "print(sorted({n['NodeManagerAddress'] for n in ray.nodes()}), ray.util.get_node_ip_address())\n"
            "ray.shutdown()\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=clean_env({"RAY_AUTH_MODE": "disabled"}))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "['127.0.0.1'] 127.0.0.1"


def test_a_rule_reward_role_scores_without_importing_torch(local_ray_fresh_workers, tiny_model):
    """The reward role of a run with rule rewards scores in a process that never imports torch (nor
    transformers: 8 s of CPU on two cores, measured, and hundreds of MB, less per reward worker while the
    model roles start), also when the run names its policy's folder."""
    from rlhf_plugins.api import prepare
    from rlhf_plugins.training.reward_role import RewardBatch, RewardRole

    cfg, pm, plan = prepare({"placement": {"strategy": "ray"}, "ray": {"ready_timeout": 5},
                             "model": {"path": tiny_model}}, autoload=False)
    p = RayPlacement(PlacementContext(cfg, ("reward", "actor")))
    try:
        reward = p.create_role("reward", RewardRole, cfg, pm.spec, plan.rewards, plan.weights)
        probe = p.create_role("actor", Probe, "a")
        p.ready()
        batch = RewardBatch(["2+3=", "1+1="], ["5", "3"], [[1], [2]], {"label": ["5", "2"]})
        assert reward.score(batch).scores == [1.0, 0.0]
        assert reward.env_info()[0]["torch_imported"] is False
        assert probe.all_reduce(2.0) == 2.0 and probe.env_info()[0]["torch_imported"] is True
    finally:
        p.shutdown()
