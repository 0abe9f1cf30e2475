"""The last rough edges a user meets: a stuck reward and SIGTERM, rewards that all abstain, why prompts
were dropped, a broken hook implementation, Ctrl-C during a plugin's import, and the reward-head load
report -- each one line (or silence) that says what happened."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time

from tests.helpers import clean_env, make_reward_model, short_run

STUCK = textwrap.dedent("""
    import time
    def stuck_after_one_step(prompts, completions, trainer_state, **kwargs):
        if trainer_state.global_step >= 1:
            time.sleep(600)  # a reward that hangs (a dead service, a deadlock): it never returns
        return [0.0] * len(completions)
""")


def test_sigterm_ends_a_run_stuck_in_its_reward_within_seconds_and_writes_its_status(tmp_path):
    (tmp_path / "stuck.py").write_text(STUCK)
    args = ["train", "--plugin", "stuck.py", "--reward.timeout", "0", *short_run("--train.run_name", "s")]
    proc = subprocess.Popen([sys.executable, "-m", "rlhf_plugins.cli", *args], cwd=tmp_path, text=True,
                            env=clean_env({"RLHF_DISABLE_PLUGIN_AUTOLOAD": "1"}), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    metrics = tmp_path / "runs" / "s" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.is_file() and metrics.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.2)  # the first step is done; the second is stuck in its reward
    time.sleep(1.0)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    took = time.monotonic() - sent
    assert proc.returncode == 143, err
    assert took < 60, took  # the step is given 10 s, then interrupted (not the 600 s the reward sleeps)
    status = json.loads((tmp_path / "runs" / "s" / "status.json").read_text())
    assert status["status"] == "interrupted" and status["steps_done"] == 1
    assert "rlhf train --resume" in err.strip().splitlines()[-1]


def test_rewards_that_abstain_on_every_sample_are_an_error_naming_them(rlhf, tmp_path):
    plugin = tmp_path / "abstains.py"
    plugin.write_text("def never(prompts, completions, **kwargs):\n    return [None] * len(completions)\n")
    code, _, err = rlhf("train", "--plugin", str(plugin), *short_run())
    assert code == 2
    line = err.strip().splitlines()[-1]
    assert "every reward source ('never') returned None for all 16 samples at step 0" in line


def test_the_dropped_prompts_warning_names_each_reason(rlhf, tmp_path):
    data = tmp_path / "d.jsonl"
    rows = [{"prompt": "1+1=", "label": "2"}, {"prompt": "", "label": "0"},
            {"prompt": "9+9=" * 300, "label": "x"}] + [{"prompt": f"{i}+1=", "label": str(i + 1)} for i in range(4)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, _, err = rlhf("train", "--data.path", str(data), "--reward.functions", "exact_match", *short_run())
    assert code == 0, err
    assert "dropped 2 of 7 prompts (1 empty, 1 longer than --data.max_prompt_tokens 256)" in err


def test_a_bad_hook_implementation_is_one_line_naming_the_plugin_and_hook(rlhf, tmp_path):
    plugin = tmp_path / "badhook.py"
    plugin.write_text("from rlhf_plugins import hookimpl\n@hookimpl\ndef rlhf_reward_functions(nonsense):\n"
                      "    return []\n")
    code, _, err = rlhf("train", "--plugin", str(plugin), *short_run())
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "plugin 'badhook' cannot be registered: its rlhf_reward_functions:" in lines[0]
    assert "nonsense" in lines[0]


def test_ctrl_c_while_a_plugin_imports_names_the_plugin(rlhf, tmp_path):
    plugin = tmp_path / "slow_import.py"
    plugin.write_text("raise KeyboardInterrupt\n")
    code, _, err = rlhf("train", "--plugin", str(plugin), *short_run())
    assert code == 130
    assert err.strip() == f"rlhf: interrupted while importing plugin '{plugin}'"


def test_loading_a_reward_model_does_not_report_its_head_as_unexpected(tmp_path, tiny_model, capfd):
    from rlhf_plugins.models.reward_model import RewardModelScorer

    path = make_reward_model(tmp_path / "rm", "openrlhf")
    capfd.readouterr()
    RewardModelScorer(str(path))(["3+4="], ["7"])
    out, err = capfd.readouterr()
    assert "UNEXPECTED" not in out + err and "score.weight" not in out + err
