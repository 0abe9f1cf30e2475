"""TRL's multi-turn arguments (tools=, environment_factory= single and dict, rollout_func=) on our
GRPOTrainer, and OpenRLHF agent files loaded unchanged with --plugin."""
from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers import run_subprocess

pytest.importorskip("trl")


@pytest.fixture(scope="module")
def tool_model():
    from rlhf_plugins.models.tool_model import tool_model_path

    return tool_model_path(quiet=True)


def dataset(n=16, env=None):
    from rlhf_plugins.models.tool_model import calculator_rows

    rows = [{"prompt": [{"role": "user", "content": r["prompt"]}], "label": r["label"]}
            for r in calculator_rows("train")[:n]]
    if env is not None:
        for i, r in enumerate(rows):
            r["environment"] = env[i % len(env)]
    return rows


def grpo_args(tmp_path, steps=2):
    from trl import GRPOConfig

    return GRPOConfig(output_dir=str(tmp_path / "runs" / "trl"), learning_rate=5e-4, num_generations=4,
                      per_device_train_batch_size=16, max_completion_length=64, beta=0.001, max_steps=steps,
                      use_cpu=True, bf16=False, report_to="none", lr_scheduler_type="constant")


SEEN: dict[str, list] = {}


def correct(prompts, completions, label, **kwargs):
    """TRL's signature: a multi-turn completion is its list of messages."""
    SEEN.setdefault("completions", []).extend(completions)
    return [1.0 if c[-1]["content"].strip() == lab else 0.0 for c, lab in zip(completions, label)]


class CalcEnv:
    """A TRL environment: reset gets the row, calculator is its tool."""

    resets: list = []

    def reset(self, **row):
        CalcEnv.resets.append(row)
        self.calls = 0
        return None

    def calculator(self, expression: str) -> str:
        """Evaluate a sum.

        Args:
            expression: numbers joined by +
        """
        from rlhf_plugins.models.tool_model import calculator

        result = calculator(expression)
        self.calls += 1
        return result


def metrics(tmp_path):
    run = next((tmp_path / "runs" / "trl").iterdir())
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "reward/mean" in line]


def test_environment_factory_runs_unchanged(tool_model, tmp_path, monkeypatch):
    from rlhf_plugins.integrations.trl import GRPOTrainer

    monkeypatch.chdir(tmp_path)
    SEEN.clear()
    CalcEnv.resets = []
    GRPOTrainer(model=tool_model, reward_funcs=correct, args=grpo_args(tmp_path), train_dataset=dataset(),
                environment_factory=CalcEnv).train()
    rows = metrics(tmp_path)
    assert len(rows) == 2 and all("env/tool_call_rate" in r for r in rows)
    # reset saw the dataset row; the reward saw whole trajectories as messages, tool replies included
    assert CalcEnv.resets and {"prompt", "label"} <= set(CalcEnv.resets[0])
    with_tool = [c for c in SEEN["completions"] if any(m["role"] == "tool" for m in c)]
    assert with_tool and with_tool[0][0]["tool_calls"][0]["function"]["name"] == "calculator"


def test_standalone_tools_run_without_an_environment(tool_model, tmp_path, monkeypatch):
    from rlhf_plugins.integrations.trl import GRPOTrainer
    from rlhf_plugins.models.tool_model import calculator

    monkeypatch.chdir(tmp_path)
    SEEN.clear()
    GRPOTrainer(model=tool_model, reward_funcs=correct, args=grpo_args(tmp_path, steps=1), train_dataset=dataset(),
                tools=[calculator]).train()
    replies = [m for c in SEEN["completions"] for m in c if m["role"] == "tool"]
    assert replies and all(m["name"] == "calculator" for m in replies)
    assert any(m["content"].isdigit() for m in replies)


def test_get_reward_is_the_reward_without_reward_funcs(tool_model, tmp_path, monkeypatch):
    from rlhf_plugins.integrations.trl import GRPOTrainer

    class Scored(CalcEnv):
        """An environment that owns the reward: its successful tool calls."""

        def get_reward(self):
            return float(self.calls)

    monkeypatch.chdir(tmp_path)
    trainer = GRPOTrainer(model=tool_model, args=grpo_args(tmp_path), train_dataset=dataset(),
                          environment_factory=Scored)
    assert trainer.raw["reward"]["functions"] == ["env_reward"]
    trainer.train()
    for r in metrics(tmp_path):  # 16 trajectories a step: mean successful calls = calls - failures / 16
        assert r["reward/mean"] == pytest.approx(r["env/tool_calls"] - r["env/tool_failures"] / 16, abs=1e-6)


def test_dict_environment_factory_routes_rows_by_their_environment(tool_model, tmp_path, monkeypatch):
    from rlhf_plugins.integrations.trl import GRPOTrainer

    class Quiz:
        """A second environment with no tools: one turn."""

        resets: list = []

        def reset(self, **row):
            Quiz.resets.append(row)
            return " Answer directly."

    monkeypatch.chdir(tmp_path)
    CalcEnv.resets, Quiz.resets = [], []
    GRPOTrainer(model=tool_model, reward_funcs=correct, args=grpo_args(tmp_path, steps=1),
                train_dataset=dataset(env=["calc", "quiz"]), environment_factory={"calc": CalcEnv, "quiz": Quiz}).train()
    calc_prompts = {r["prompt"][0]["content"] for r in CalcEnv.resets}
    quiz_prompts = {r["prompt"][0]["content"] for r in Quiz.resets}
    rows = dataset(env=["calc", "quiz"])
    assert calc_prompts and quiz_prompts and not calc_prompts & quiz_prompts
    assert calc_prompts <= {r["prompt"][0]["content"] for r in rows if r["environment"] == "calc"}
    assert all("environment" not in r for r in CalcEnv.resets)  # the selector is not passed to reset


def test_bad_environment_factory_key_is_one_line(tool_model, tmp_path):
    from rlhf_plugins.errors import ConfigError
    from rlhf_plugins.integrations.trl import GRPOTrainer

    with pytest.raises(ConfigError, match="environment_factory key 'My Env' cannot name an environment"):
        GRPOTrainer(model=tool_model, reward_funcs=correct, args=grpo_args(tmp_path), train_dataset=dataset(),
                    environment_factory={"My Env": CalcEnv})
    with pytest.raises(ConfigError, match="no reward source"):
        GRPOTrainer(model=tool_model, args=grpo_args(tmp_path), train_dataset=dataset(), environment_factory=CalcEnv)


def test_rollout_func_takes_over_generation_with_env_mask(tool_model, tmp_path, monkeypatch):
    from rlhf_plugins.integrations.trl import GRPOTrainer

    calls = []

    def rollout_func(prompts, trainer):
        """Sample with the run's engine, append a fixed feedback token run, mask it."""
        tok = trainer.processing_class
        ids = [tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False)
               for p in prompts]
        out = trainer.generate(ids, n=trainer.num_generations, max_new_tokens=8)
        feedback = tok("<|user|>ok", add_special_tokens=False)["input_ids"]
        calls.append((len(prompts), trainer.num_generations))
        return {"prompt_ids": ids,
                "completion_ids": [c + feedback for c in out.completion_ids],
                "logprobs": [lp + [0.0] * len(feedback) for lp in out.logprobs],
                "env_mask": [[1] * len(c) + [0] * len(feedback) for c in out.completion_ids],
                "source": ["custom"] * len(out.completion_ids)}

    def saw_source(prompts, completions, source, **kwargs):
        assert set(source) == {"custom"}
        return [0.0] * len(completions)

    monkeypatch.chdir(tmp_path)
    GRPOTrainer(model=tool_model, reward_funcs=[saw_source], args=grpo_args(tmp_path), train_dataset=dataset(),
                rollout_func=rollout_func).train()
    assert calls == [(4, 4), (4, 4)]
    rows = metrics(tmp_path)
    # the trained length counts the model's tokens only (the feedback is masked)
    assert all(r["completion/length"] <= 8 for r in rows)


def test_a_rollout_func_written_for_trls_vllm_helper_samples_from_the_runs_engine(tool_model, tmp_path, monkeypatch):
    """trainer.vllm_generation.generate(prompts, images, num_generations), as TRL's rollout functions call
    its vLLM helper (each prompt repeated num_generations times): one completion per entry, TRL's tuple
    back, and log-probs that are the run's engine's -- the learner's recomputation of them differs by
    float rounding only (the run logs the gap)."""
    from rlhf_plugins.integrations.trl import GRPOTrainer

    seen = []

    def rollout_func(prompts, trainer):
        tok, n = trainer.processing_class, trainer.num_generations
        ids = [tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False)
               for p in prompts]
        trainer.vllm_generation.sync_weights()
        repeated = [i for i in ids for _ in range(n)]
        prompt_ids, completion_ids, logprobs, token_ids = trainer.vllm_generation.generate(
            prompts=repeated, images=None, num_generations=n)
        seen.append((prompt_ids == repeated, len(completion_ids), token_ids == [[[t] for t in c] for c in completion_ids],
                     all(len(lp) == len(c) and all(x[0] <= 0 for x in lp) for lp, c in zip(logprobs, completion_ids))))
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids,
                "logprobs": [[x[0] for x in row] for row in logprobs]}

    monkeypatch.chdir(tmp_path)
    GRPOTrainer(model=tool_model, reward_funcs=[correct], args=grpo_args(tmp_path), train_dataset=dataset(),
                rollout_func=rollout_func).train()
    assert seen == [(True, 16, True, True)] * 2
    rows = metrics(tmp_path)
    assert len(rows) == 2 and all(0 < r["completion/length"] <= 64 for r in rows)
    assert all(r["mismatch/abs_log_ratio"] < 1e-4 for r in rows), [r["mismatch/abs_log_ratio"] for r in rows]


AGENT = '''
import torch
from openrlhf.utils.agent import AgentInstanceBase


class AgentInstance(AgentInstanceBase):
    """Scores the answer against the label; gives one hint on a wrong answer."""

    def __init__(self, *args, **kwargs):
        self.turn = 0

    async def reset(self, states: dict, **kwargs):
        self.turn = 0
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs):
        self.turn += 1
        answer = states["action_text"].replace("<|eos|>", "").strip()
        right = answer == states["label"]
        done = right or self.turn >= 2
        return {"rewards": torch.tensor(1.0 if right else 0.0), "scores": torch.tensor(1.0 if right else 0.0),
                "environment_feedback": "" if done else "<|user|>try again<|assistant|>", "done": done,
                "extra_logs": {}}
'''


def test_openrlhf_agent_file_loads_unchanged_with_plugin(tmp_path, tool_model):
    agent = tmp_path / "agent_func.py"
    agent.write_text(AGENT)
    out = run_subprocess("train", "--plugin", str(agent), "--model.path", tool_model,
                         "--data.path", "builtin:calculator-train", "--train.steps", "2",
                         "--train.prompts_per_step", "4", "--generation.n_samples_per_prompt", "4",
                         "--train.progress", "false", "--eval.enabled", "false", cwd=tmp_path,
                         env={"RLHF_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert out.returncode == 0, out.stderr
    run = next((tmp_path / "runs").iterdir())
    config = (run / "config.yaml").read_text()
    assert "name: agent_func" in config and "env_reward" in config
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if "reward/mean" in x]
    # the agent decides when a trajectory ends: a right answer, or after the hint's second turn
    assert all(r["env/finish_env_done"] == 1.0 and 1 <= r["env/turns"] <= 2 for r in rows)
    assert any(r["env/env_tokens"] > 0 for r in rows)


def test_agent_file_without_openrlhf_uses_our_base_classes(tmp_path):
    from rlhf_plugins.core.manager import create_manager
    from rlhf_plugins.environments.openrlhf import AgentInstanceBase
    from rlhf_plugins.types import Environment

    agent = tmp_path / "my_agent.py"
    agent.write_text(AGENT)
    pm = create_manager([str(agent)], autoload=False)
    env = pm.components.get(Environment, "my_agent")
    assert issubclass(env.factory, AgentInstanceBase)
    # the stand-in modules served that import only: no module named openrlhf is left in this process
    assert not [name for name in sys.modules if name.split(".")[0] == "openrlhf"]


EXECUTOR_FORM = AGENT.replace("import AgentInstanceBase", "import AgentInstanceBase, MultiTurnAgentExecutor").replace(
    "class AgentInstance(", "class ToolTurn(") + """

class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(ToolTurn)
"""


def test_an_agent_file_in_openrlhfs_executor_form_registers_the_class_its_executor_names(tmp_path):
    """OpenRLHF's current agent files end in ``class AgentExecutor(MultiTurnAgentExecutor)`` naming their
    agent class (any name): the stand-in module has the executor, and the class it names is the
    environment's factory."""
    from rlhf_plugins.core.manager import create_manager
    from rlhf_plugins.types import Environment

    agent = tmp_path / "agent_func.py"
    agent.write_text(EXECUTOR_FORM)
    pm = create_manager([str(agent)], autoload=False)
    env = pm.components.get(Environment, "agent_func")
    assert env.factory.__name__ == "ToolTurn" and env.description.startswith("Scores the answer")


def test_an_agent_executor_with_its_own_loop_and_no_agent_class_is_one_line(tmp_path, capsys):
    from rlhf_plugins.cli import main

    agent = tmp_path / "loop.py"
    agent.write_text("from openrlhf.utils.agent import AgentExecutorBase\n\n\n"
                     "class AgentExecutor(AgentExecutorBase):\n"
                     "    async def execute(self, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine):\n"
                     "        return {}\n")
    assert main(["train", "--plugin", str(agent), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("rlhf: error: plugin 'loop' defines an OpenRLHF AgentExecutor that names no agent class (its own "
                   "execute() loop); rlhf-plugins runs the turns itself: define the AgentInstance (async reset / step) "
                   "that OpenRLHF's MultiTurnAgentExecutor takes")


def test_a_file_using_openrlhfs_helpers_without_openrlhf_is_one_line_saying_so(tmp_path, capsys):
    """OpenRLHF's math_reward_func.py imports its grading helpers (``openrlhf.utils``), which only
    OpenRLHF has: the import error says to install it."""
    import importlib.util

    from rlhf_plugins.cli import main

    if importlib.util.find_spec("openrlhf") is not None:
        pytest.skip("OpenRLHF is installed here: its helpers import")

    path = tmp_path / "math_reward_func.py"
    path.write_text("from openrlhf.utils import extract_boxed_answer, grade_answer\n\n\n"
                    "def reward_func(queries, prompts, labels, **kwargs):\n    return [0.0] * len(queries)\n")
    assert main(["train", "--plugin", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "No module named 'openrlhf'" in err
    assert err.endswith("the file uses OpenRLHF's own helpers: pip install openrlhf (without it only "
                        "openrlhf.utils.agent's base classes and multi-turn executor are provided here)")


def test_examples_doc_snippet_names_match(tmp_path):
    """docs/from_trl.md documents the multi-turn arguments with these names."""
    doc = (Path(__file__).resolve().parent.parent / "docs" / "from_trl.md").read_text()
    for word in ("environment_factory", "rollout_func", "tools=", "env_reward"):
        assert word in doc


RAY_SCRIPT = '''
from trl import GRPOConfig

from rlhf_plugins.integrations.trl import GRPOTrainer
from rlhf_plugins.models.tool_model import calculator_rows, tool_model_path


class Calc:
    """Defined in the script: shipped to the Ray workers by value with the plugin."""

    def reset(self, **row):
        return None

    def calculator(self, expression: str) -> str:
        """Evaluate a sum.

        Args:
            expression: numbers joined by +
        """
        return str(sum(int(x) for x in expression.split("+")))


def correct(prompts, completions, label, **kwargs):
    return [1.0 if c[-1]["content"].strip() == l else 0.0 for c, l in zip(completions, label)]


rows = [{"prompt": [{"role": "user", "content": r["prompt"]}], "label": r["label"]} for r in calculator_rows("train")]
args = GRPOConfig(output_dir="runs/trl-env-ray", learning_rate=5e-4, num_generations=4, per_device_train_batch_size=16,
                  max_completion_length=64, max_steps=2, use_cpu=True, bf16=False, report_to="none")
GRPOTrainer(model=tool_model_path(), reward_funcs=correct, args=args, train_dataset=rows, environment_factory=Calc,
            rlhf={"placement": {"strategy": "ray"}, "ray": {"local_num_gpus": 4}}).train()
'''


def test_trl_environment_runs_under_ray_placement(tmp_path, tool_model):
    import subprocess
    import sys

    from tests.helpers import clean_env

    (tmp_path / "train_env.py").write_text(RAY_SCRIPT)
    proc = subprocess.run([sys.executable, "train_env.py"], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env=clean_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = next((tmp_path / "runs" / "trl-env-ray").iterdir())
    assert "strategy: ray" in (run / "config.yaml").read_text()
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if "reward/mean" in x]
    assert len(rows) == 2 and all(r["env/turns"] >= 1 for r in rows)
    assert any(r["env/tool_calls"] > 0 and r["env/env_tokens"] > 0 for r in rows)


def test_a_plugin_rlhf_rollout_hook_takes_over_generation(rlhf, tmp_path):
    """The hook behind rollout_func, from a plugin file: its samples are trained on, its masked
    reply is not, and its extra field reaches the reward function."""
    plugin = tmp_path / "own_rollout.py"
    plugin.write_text(textwrap.dedent('''
        from rlhf_plugins import RewardFunction, hookimpl

        @hookimpl
        def rlhf_rollout(prompts, rows, params, engine, tokenizer):
            ids = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                 tokenize=True, return_dict=False) for p in prompts]
            out = engine.generate(ids, params)
            reply = tokenizer("<|user|>ok", add_special_tokens=False)["input_ids"]
            return {"prompt_ids": ids, "completion_ids": [c + reply for c in out.completion_ids],
                    "logprobs": [lp + [0.0] * len(reply) for lp in out.logprobs],
                    "env_mask": [[1] * len(c) + [0] * len(reply) for c in out.completion_ids],
                    "origin": ["plugin"] * len(out.completion_ids)}

        def from_plugin(prompts, completions, origin, **kwargs):
            return [1.0 if o == "plugin" else 0.0 for o in origin]

        @hookimpl
        def rlhf_reward_functions():
            yield RewardFunction("from_plugin", from_plugin)
        '''))
    code, _, err = rlhf("train", "--plugin", str(plugin), "--reward.functions", "from_plugin", "--train.steps", "2",
                        "--train.prompts_per_step", "4", "--generation.n_samples_per_prompt", "4",
                        "--train.progress", "false", "--eval.enabled", "false")
    assert code == 0, err
    run = next(Path("runs").iterdir())
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if "reward/mean" in x]
    assert all(r["reward/mean"] == 1.0 for r in rows)  # every sample came from the hook
    assert all(r["completion/length"] <= 6 for r in rows)  # the masked reply is not counted as trained
