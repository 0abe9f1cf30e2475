"""Pure helpers on their own: weight buckets, name checks, batch sharding, prompt balancing,
result merging, the seeds of an engine's share and of a prompt's request, and the default
model-worker view of an engine."""
from __future__ import annotations

import pytest
import torch

from rlhf_plugins import Samples, SamplingParams, on_model_workers
from rlhf_plugins.backend_data import derived_seed
from rlhf_plugins.dispatch import (
    balance,
    dispatch,
    dispatch_mode,
    merge_results,
    merge_samples,
    shard_batch,
    share_arguments,
)
from rlhf_plugins.models.weights import WeightSyncError
from rlhf_plugins.sync.broadcast import Bucket, buckets, check_names


def named(*specs):
    return [(f"w{i}", torch.full(shape, float(i), dtype=dtype)) for i, (shape, dtype) in enumerate(specs)]


def test_buckets_pack_same_dtype_tensors_up_to_the_size_and_unpack_exactly():
    tensors = named(((2, 3), torch.float32), ((4,), torch.float32), ((5,), torch.float32), ((2,), torch.bfloat16),
                    ((3,), torch.float32))
    out = list(buckets(tensors, bucket_bytes=48))  # 12 floats
    # 6 + 4 floats fit (40 B), the third would pass 48 B; the dtype change always starts a new bucket
    assert [b.names for b, _ in out] == [["w0", "w1"], ["w2"], ["w3"], ["w4"]]
    assert [b.dtype for b, _ in out] == ["torch.float32", "torch.float32", "torch.bfloat16", "torch.float32"]
    for bucket, parts in out:
        flat = torch.cat(parts)
        assert bucket.numel == flat.numel()
        for name, view in bucket.unpack(flat):
            assert torch.equal(view, dict(tensors)[name])
    per_tensor = list(buckets(tensors, bucket_bytes=0))
    assert [len(b.names) for b, _ in per_tensor] == [1] * 5


def test_bucket_dtype_round_trips():
    assert Bucket("torch.bfloat16").torch_dtype is torch.bfloat16


def test_check_names_accepts_dtype_changes_and_names_what_does_not_fit():
    learner = {"a": ((2, 2), "torch.float32"), "b": ((3,), "torch.float32")}
    check_names(learner, {"a": ((2, 2), "torch.bfloat16"), "b": ((3,), "torch.float32"), "extra": ((1,), "x")})
    with pytest.raises(WeightSyncError, match="engine has no tensor named 'b' \\(1 of 2 learner names are unknown"):
        check_names(learner, {"a": ((2, 2), "torch.float32")})
    with pytest.raises(WeightSyncError, match="'b' is \\(3,\\) in the learner but \\(4,\\) in the engine"):
        check_names(learner, {"a": ((2, 2), "torch.float32"), "b": ((4,), "torch.float32")})
    with pytest.raises(WeightSyncError, match="'b' is torch.float32 in the learner but torch.int64"):
        check_names(learner, {"a": ((2, 2), "torch.float32"), "b": ((3,), "torch.int64")})


def test_shard_batch_keeps_prompt_groups_whole_and_weights_ranks():
    B, group = 12, 3
    batch = {"sequences": torch.arange(B)[:, None], "action_mask": torch.ones(B, 2), "ids": list(range(B)),
             "group_size": group, "prompt_width": 5}
    shards = shard_batch(batch, 3)
    assert [s["sequences"][:, 0].tolist() for s in shards] == [[0, 1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11]]
    assert shards[1]["ids"] == [6, 7, 8] and all(s["group_size"] == 3 and s["prompt_width"] == 5 for s in shards)

    class Objective:
        @staticmethod
        def weight(micro, mini):
            return float(micro.sum()) / float(mini.sum())

    weighted = shard_batch(batch, 3, objective=Objective())
    assert [s["dp_weight"] for s in weighted] == pytest.approx([6 / 12 * 3, 3 / 12 * 3, 3 / 12 * 3])
    # not whole groups: single samples
    odd = shard_batch({"sequences": torch.arange(5)[:, None], "group_size": 2}, 2)
    assert [len(s["sequences"]) for s in odd] == [3, 2]


def test_balance_spreads_load_evenly_and_keeps_every_index():
    loads = [9, 1, 1, 1, 8, 2, 3]
    shares = balance(loads, 3)
    # longest first, each to the lightest share: 9 | 8 | 3+2+1+1+1
    assert shares == [[0], [4], [1, 2, 3, 5, 6]]
    assert sorted(sum(loads[i] for i in s) for s in shares) == [8, 8, 9]
    assert balance([5], 3) == [[0], [], []]


def test_merge_results_concatenates_tensors_and_averages_metrics():
    assert torch.equal(merge_results([torch.tensor([1, 2]), torch.tensor([3])]), torch.tensor([1, 2, 3]))
    assert merge_results([{"loss": 1.0, "n": 2}, {"loss": 3.0, "n": 4}]) == {"loss": 2.0, "n": 3.0}
    assert merge_results([None, None]) is None


def test_merge_samples_restores_prompt_order():
    def part(prompts, n):
        s = Samples()
        for j, p in enumerate(prompts):
            for k in range(n):
                s.prompt_index.append(j)
                s.completion_ids.append([p, k])
                s.logprobs.append([-0.1 * p])
                s.finish_reasons.append("stop")
        return s

    shares = [[0, 3], [1, 2]]  # engine 0 got prompts 0 and 3, engine 1 prompts 1 and 2
    merged = merge_samples(shares, [part([0, 3], 2), part([1, 2], 2)])
    assert merged.prompt_index == [0, 0, 1, 1, 2, 2, 3, 3]
    assert merged.completion_ids == [[0, 0], [0, 1], [1, 0], [1, 1], [2, 0], [2, 1], [3, 0], [3, 1]]
    assert merged.logprobs[6] == [-0.30000000000000004]


def test_derived_seeds_are_fixed_distinct_and_leave_room_for_a_requests_samples():
    seeds = [derived_seed(s, k) for s in range(50) for k in range(50)] + [derived_seed(7, "engine", k) for k in range(50)]
    assert seeds[:3] == [derived_seed(0, 0), derived_seed(0, 1), derived_seed(0, 2)]
    assert all(0 <= s < 2**62 for s in seeds)
    # no two within 64 of each other: a request's k-th sample (vLLM: its seed + k) never takes another's stream
    ordered = sorted(seeds)
    assert len(ordered) == 2550 and min(b - a for a, b in zip(ordered, ordered[1:])) > 64


def test_each_engines_share_gets_sampling_parameters_with_a_seed_of_its_own():
    params = SamplingParams(n=4, max_new_tokens=9, temperature=0.7, seed=11)
    calls = [share_arguments((["prompts"], params), {"extra": params, "flag": True}, k) for k in range(3)]
    for k, (args, kwargs) in enumerate(calls):
        want = SamplingParams(n=4, max_new_tokens=9, temperature=0.7, seed=derived_seed(11, "engine", k))
        assert args == (["prompts"], want) and kwargs == {"extra": want, "flag": True}
    assert len({args[1].seed for args, _ in calls} | {11}) == 4
    unseeded = SamplingParams(n=2)
    assert share_arguments(([], unseeded), {}, 1) == (([], unseeded), {})


def test_dispatch_marks():
    class Role:
        @dispatch("split")
        def train(self):
            pass

        def other(self):
            pass

    assert dispatch_mode(Role, "train") == "split" and dispatch_mode(Role, "other") == "one"
    with pytest.raises(ValueError, match="unknown dispatch mode 'each'"):
        dispatch("each")


def test_an_engine_without_model_workers_is_its_own_worker_with_lasting_state():
    class Engine:
        def __init__(self):
            self.loaded = []

        def load_weights(self, named):
            self.loaded += [n for n, _ in named]
            return {"tensors": len(self.loaded)}

    engine = Engine()

    def remember(worker, value):
        worker.state.setdefault("seen", []).append(value)
        return worker.rank, worker.load_weights([("x", None)]), list(worker.state["seen"])

    assert on_model_workers(engine, remember, 1) == [(0, {"tensors": 1}, [1])]
    assert on_model_workers(engine, remember, 2) == [(0, {"tensors": 2}, [1, 2])]  # state survives


def test_an_engine_with_model_workers_runs_the_function_in_each():
    class Sharded:
        def model_workers(self, fn, *args):
            return [fn(type("W", (), {"rank": r, "state": {}})(), *args) for r in range(3)]

    assert on_model_workers(Sharded(), lambda w, x: w.rank * x, 10) == [0, 10, 20]


def test_a_groups_port_is_free_and_below_the_kernels_ephemeral_range(monkeypatch):
    """Rank 0 binds its port seconds after it is chosen: below the ephemeral range (Linux: 20000-32767)
    no outgoing connection can be handed it meanwhile (a port from that range once failed a CI run's
    ZeRO-3 start with EADDRINUSE). Without room below the range, the kernel's pick."""
    import socket

    from rlhf_plugins.sync import groups

    start = groups._ephemeral_start()
    ports = [groups.free_port() for _ in range(20)]
    if start - groups.LOWEST_PORT >= 64:
        assert all(groups.LOWEST_PORT <= p < start for p in ports), ports
    for port in ports[:3]:  # each one can be bound
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))
    monkeypatch.setattr(groups, "_ephemeral_start", lambda: groups.LOWEST_PORT + 10)  # no room below the range
    assert groups.free_port() >= start  # the kernel picks from its own ephemeral range
    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("", 0))
    try:  # a port in use is passed over
        monkeypatch.setattr(groups.random.Random, "randint", lambda self, a, b: taken.getsockname()[1])
        monkeypatch.setattr(groups, "_ephemeral_start", lambda: 40000)
        assert groups.free_port(tries=3) != taken.getsockname()[1]
    finally:
        taken.close()
