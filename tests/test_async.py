"""Asynchronous training: the rollout worker gives the synchronous loop's results when it may not
run ahead, keeps every sample within the staleness bound, records per-token policy versions
(partial rollouts continue token-exactly from their prefix), resumes from the consumed position,
and refuses uncorrected staleness."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlhf_plugins.training.runlog import MEASURED
from tests.helpers import eval_rows_of, in_process_trainer, metrics_of, short_run, the_run

CORRECTED = ("--algo.policy_loss.mismatch", "tis")


def comparable(metrics):
    return {k: v for k, v in metrics.items() if not k.startswith((*MEASURED, "async/"))}


def test_the_worker_held_to_zero_staleness_reproduces_the_synchronous_loop(tiny_model, tmp_path, monkeypatch):
    """K = 0 through the rollout worker (generation in its own thread, weights synced by the worker
    before each rollout) gives the synchronous loop's metrics step for step, bit for bit."""
    from rlhf_plugins.training.async_rollouts import async_step

    monkeypatch.chdir(tmp_path)
    # one generation call per rollout, as the synchronous loop makes (parts: the next test)
    raw = {"train": {"prompts_per_step": 4, "steps": 4}, "generation": {"n_samples_per_prompt": 4, "rollout_parts": 1},
           "learner": {"epochs": 2}, "algo": {"kl": {"coef": 0.05}}}
    sync = in_process_trainer(tiny_model, raw)
    expected = [sync.step(s) for s in range(4)]
    worker_driven = in_process_trainer(tiny_model, raw)
    try:
        got = [async_step(worker_driven, s) for s in range(4)]
    finally:
        worker_driven.shutdown()
    assert [comparable(m) for m in got] == [comparable(m) for m in expected]
    assert all(m["async/staleness_max"] == 0 for m in got)
    assert expected[3]["kl"] != 0  # the policy did move away from the reference: the runs compared are not trivial


def test_a_rollout_made_in_parts_is_scored_whole_with_the_reference_of_each_part(tiny_model, tmp_path, monkeypatch):
    """generation.rollout_parts 3: the step's prompts (in the sampler's order) are generated in three
    calls of whole prompt groups, each with its own seed; the reference log-probs gathered from the
    parts equal the reference model's on the whole batch; rewards are those of the whole rollout."""
    from rlhf_plugins.training.async_rollouts import RolloutWorker
    from rlhf_plugins.training.rollout import make_batch

    monkeypatch.chdir(tmp_path)
    raw = {"train": {"prompts_per_step": 6, "max_staleness": 1}, "algo": {"policy_loss": {"mismatch": "tis"}},
           "generation": {"n_samples_per_prompt": 3, "rollout_parts": 3, "temperature": 1.5}}
    t = in_process_trainer(tiny_model, raw)
    calls, generate = [], t.engine.generate
    t.engine.generate = lambda ids, params: calls.append((len(ids), params.seed)) or generate(ids, params)
    try:
        order = t.sampler.__class__(len(t.prompts), 0, t.config.data.shuffle).take(6)
        worker = RolloutWorker(t, start=False)
        rollout, metrics, pending = worker._collect(step=0)
        batch = pending.result()
        whole = t.reference.logprobs(make_batch(rollout, t.pad_id, **t.widths))  # the trainer's own layout
    finally:
        t.shutdown()
    assert [n for n, _ in calls] == [2, 2, 2] and len({seed for _, seed in calls}) == 3
    assert rollout.prompts == [t.prompts.prompts[i] for i in order for _ in range(3)]
    mask = batch["action_mask"].bool()
    assert batch["ref_logprobs"].shape == whole.shape
    assert torch.allclose(batch["ref_logprobs"][mask], whole[mask], atol=1e-5)
    assert metrics["reward/mean"] == pytest.approx(sum(rollout.raw_scores) / 18) and len(rollout.scores) == 18
    assert metrics["time/reference"] > 0


@pytest.mark.parametrize("backend", ["transformers", pytest.param("vllm", marks=pytest.mark.integration)])
def test_a_partial_rollout_takes_new_weights_between_chunks_and_continues_token_exactly(tiny_model, tmp_path,
                                                                                      monkeypatch, backend):
    """Weights published mid-generation are synced between chunks: the first chunk's tokens carry
    the old version, the rest the new one, and the continued samples are exactly what the engine
    sampled (the learner's log-probs of the whole sequence match the engine's, chunk by chunk)."""
    from rlhf_plugins.training.async_rollouts import RolloutWorker
    from rlhf_plugins.training.rollout import make_batch

    if backend == "vllm":
        pytest.importorskip("vllm")
        monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.chdir(tmp_path)
    raw = {"train": {"prompts_per_step": 4, "max_staleness": 1}, "generation": {
        "backend": backend, "n_samples_per_prompt": 4, "max_new_tokens": 10, "partial_rollout": True,
        "partial_chunk_tokens": 1, "temperature": 1.5}, "algo": {"policy_loss": {"mismatch": "tis"}}}
    t = in_process_trainer(tiny_model, raw)
    try:
        t.worker = RolloutWorker(t, start=False)
        t.worker.learner_version = 1  # the learner has published an update the engine has not seen
        rollout = t.generate(step=1)
    finally:
        t.shutdown()
    lengths = [len(ids) for ids in rollout.completion_ids]
    assert all(len(v) == n for v, n in zip(rollout.versions, lengths))
    # chunks of one token: every answer ("7" then EOS) continues past its first chunk under new weights
    assert all(v == [0] * n if n <= 1 else v == [0] + [1] * (n - 1) for v, n in zip(rollout.versions, lengths))
    assert any(n > 1 for n in lengths), lengths  # something did continue past the first chunk
    assert t.engine_version == 1
    for ids, why in zip(rollout.completion_ids, rollout.finish_reasons):
        assert (why == "stop") == (ids[-1] == t.tokenizer.eos_token_id) and (why == "stop" or len(ids) == 10)
    batch = make_batch(rollout, t.pad_id)
    learner = t.actor.logprobs(batch)
    mask = batch["action_mask"].bool()
    assert torch.allclose(learner[mask], batch["rollout_logprobs"][mask], atol=1e-4)


def test_staleness_stays_within_the_bound_with_filtering_and_evaluation(rlhf):
    """K = 2 with dynamic filtering and held-out evaluation sharing the engine: every token is at
    most two versions old, the lag fractions add up, and the evaluation rows land as usual."""
    code, _, err = rlhf("train", *short_run("--train.steps", "6", "--train.max_staleness", "2", *CORRECTED,
                                            "--reward.dynamic_filtering", "true", "--eval.enabled", "true",
                                            "--eval.every", "3", "--eval.max_prompts", "8"))
    assert code == 0, err
    rows = metrics_of(the_run())
    assert [r["step"] for r in rows] == list(range(6))
    for r in rows:
        assert 0 <= r["async/staleness_mean"] <= r["async/staleness_max"] <= min(2, r["step"])
        lags = {k: v for k, v in r.items() if k.startswith("async/tokens_lag")}
        assert abs(sum(lags.values()) - 1) < 1e-9 and max(int(k.removeprefix("async/tokens_lag")) for k in lags) <= 2
        assert r["async/queue"] <= 2 and r["async/learner_idle"] >= 0 and r["async/engine_idle"] >= 0
    assert any(r["async/staleness_max"] >= 1 for r in rows)  # it did run ahead
    assert [r["step"] for r in eval_rows_of(the_run())] == [0, 3, 6]


ADMIT = """
from rlhf_plugins import hookimpl
@hookimpl
def rlhf_admit_rollout(step, learner_version, engine_version, queued, max_staleness):
    open({log!r}, "a").write(f"{{step}} {{learner_version}} {{engine_version}} {{len(queued)}}\\n")
    return {answer}
"""


@pytest.mark.parametrize("answer, k, lag", [("learner_version >= step", 2, 0), ("True", 1, 1)])
def test_the_admission_hook_can_hold_generation_back_but_never_make_it_staler(rlhf, tmp_path, answer, k, lag):
    log = tmp_path / "admit.log"
    (tmp_path / "admit.py").write_text(ADMIT.format(log=str(log), answer=answer))
    code, _, err = rlhf("train", "-p", "admit.py", *short_run("--train.steps", "4", "--train.max_staleness", str(k),
                                                              *CORRECTED))
    assert code == 0, err
    rows = metrics_of(the_run())
    assert [r["async/staleness_max"] for r in rows] == [0] + [lag] * 3
    asked = [tuple(map(int, line.split())) for line in log.read_text().splitlines()]
    assert {s for s, *_ in asked} == {0, 1, 2, 3}
    assert all(learner >= step - k for step, learner, _, _ in asked)  # asked only within the bound


def test_resume_continues_from_the_first_rollout_not_trained_on(rlhf):
    """The worker runs ahead of the learner, but the checkpoint records the sampler where the
    synchronous loop would have it; resuming continues the steps once each."""
    code, _, err = rlhf("train", *short_run("--train.run_name", "sync"))
    assert code == 0, err
    code, _, err = rlhf("train", *short_run("--train.run_name", "ahead", "--train.max_staleness", "2", *CORRECTED))
    assert code == 0, err
    sampler = lambda name: torch.load(next(Path(f"runs/{name}/checkpoints").glob("step-*")) / "trainer.pt",  # noqa: E731
                                      weights_only=True)["sampler"]
    assert sampler("ahead") == sampler("sync")
    code, out, err = rlhf("train", "--resume", "runs/ahead", "--train.steps", "5")
    assert code == 0, err
    rows = metrics_of(Path("runs/ahead"))
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert rows[3]["async/staleness_max"] == 0  # the queue was regenerated from the restored policy
    assert json.loads(Path("runs/ahead/summary.json").read_text())["steps"] == 5


@pytest.mark.parametrize("args, expected", [
    (["--train.max_staleness", "1"], "train.max_staleness 1 trains on samples of policies up to 1 update behind the learner, and "
     "algo.policy_loss.mismatch is none, so nothing corrects for it; use --algo.policy_loss.mismatch tis"),
    (["--generation.partial_rollout", "true"], "generation.partial_rollout swaps weights during a generation, "
     "which needs asynchronous training; set --train.max_staleness 1"),
])
def test_uncorrected_staleness_and_pointless_partial_rollouts_are_refused(rlhf, args, expected):
    code, _, err = rlhf("train", "--dry-run", *args)
    assert code == 2 and expected in err and len(err.strip().splitlines()) == 1, err


def test_what_reward_functions_log_and_the_epoch_reach_the_metrics_of_rollouts_made_in_parts(rlhf, tmp_path):
    """Generating ahead with a reference model, a step's prompts are generated in parts (two by default)
    and scored whole: the metric a TRL-style reward function logs and the passes over the prompts reach
    every step's metrics there too."""
    plugin = tmp_path / "logging_reward.py"
    plugin.write_text("def logs(completions, log_metric, **kwargs):\n"
                      "    log_metric('my/length', sum(map(len, completions)) / len(completions))\n"
                      "    return [float(len(c) < 3) for c in completions]\n")
    code, _, err = rlhf("train", "--plugin", str(plugin), *short_run("--train.max_staleness", "1", *CORRECTED,
                                                                     "--algo.kl.coef", "0.01", "--data.max_samples", "10"))
    assert code == 0, err
    rows = metrics_of(the_run())
    assert all(r["my/length"] >= 0 for r in rows) and len(rows) == 3
    assert [r["epoch"] for r in rows] == pytest.approx([0.4, 0.8, 1.2])  # 4 of the 10 prompts a step


def test_uncorrected_staleness_runs_when_asked_for(rlhf):
    code, _, err = rlhf("train", *short_run("--train.max_staleness", "1", "--train.allow_uncorrected_staleness", "true"))
    assert code == 0, err
    rows = metrics_of(the_run())
    assert [r["async/staleness_max"] for r in rows] == [0, 1, 1]
    assert all("mismatch/abs_log_ratio" in r for r in rows)  # measured, not corrected


def test_partial_rollouts_record_mixed_versions_in_a_whole_run(rlhf, tmp_path):
    """A whole run with one-token chunks: every sample is continued from its prefix, weights may
    arrive between any two tokens, and every token stays within the bound."""
    code, _, err = rlhf("train", *short_run("--train.steps", "5", "--train.max_staleness", "1", *CORRECTED,
                                            "--generation.partial_rollout", "true",
                                            "--generation.partial_chunk_tokens", "1",
                                            "--generation.max_new_tokens", "12", "--generation.temperature", "2.0"))
    assert code == 0, err
    rows = metrics_of(the_run())
    assert all(r["async/staleness_max"] <= 1 for r in rows)
    assert max(r["completion/length"] for r in rows) > 1  # samples continued past their first one-token chunk


def test_ppo_with_a_critic_trains_on_stale_rollouts(rlhf):
    """GAE's values come from the critic at training time, so a critic works asynchronously too."""
    code, _, err = rlhf("train", *short_run("--train.max_staleness", "1", *CORRECTED,
                                            "--algo.advantage.estimator", "gae"))
    assert code == 0, err
    rows = metrics_of(the_run())
    assert [r["async/staleness_max"] for r in rows] == [0, 1, 1]
    assert all("critic/loss" in r for r in rows)
