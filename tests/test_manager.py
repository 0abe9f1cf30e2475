from __future__ import annotations

import sys
import textwrap

import pytest

from rlhf_plugins import (
    AdvantageEstimator,
    ConfigError,
    GenerationBackend,
    PluginError,
    PolicyLoss,
    RewardFunction,
    hookimpl,
)
from rlhf_plugins.builtin_plugins import DEFAULT_PLUGINS
from rlhf_plugins.core.manager import create_manager
from rlhf_plugins.testing import record_hooks, registered


def test_builtins_register_every_area(rlhf_pm):
    names = {name for name, _ in rlhf_pm.list_name_plugin()}
    assert {m.rsplit(".", 1)[-1] for m in DEFAULT_PLUGINS} <= names
    reg = rlhf_pm.components
    assert reg.names(AdvantageEstimator) == ["batch_mean", "dr_grpo", "gae", "group_mean_batch_std", "group_norm",
                                             "reinforce", "reinforce_baseline", "rloo"]
    assert reg.provider(AdvantageEstimator, "group_norm") == "advantages"
    assert all(info.source == "builtin" for info in rlhf_pm.infos.values())


def test_unknown_component_lists_choices(rlhf_pm):
    with pytest.raises(ConfigError) as exc:
        rlhf_pm.components.get(AdvantageEstimator, "x")
    assert str(exc.value) == (
        "unknown advantage estimator 'x'; choose one of: batch_mean, dr_grpo, gae, group_mean_batch_std, group_norm, "
        "reinforce, reinforce_baseline, rloo"
    )


def test_another_frameworks_name_for_a_builtin_names_ours(rlhf_pm):
    """verl's estimator and loss names, and torch's or vLLM's words for a backend or a sync, point at the
    builtin that is theirs here -- each one a registered name of its area; a name of nothing gets no pointer."""
    from rlhf_plugins.core.registry import ELSEWHERE
    from rlhf_plugins.types import AREAS

    by_area = {cls.area: cls for cls in AREAS.values()}
    assert ("advantage estimator", "grpo") in ELSEWHERE
    for (area, theirs), (ours, what) in ELSEWHERE.items():
        cls = by_area[area]
        assert ours in rlhf_pm.components.names(cls), (area, ours)
        with pytest.raises(ConfigError) as exc:
            rlhf_pm.components.get(cls, theirs.upper())  # as a user may spell it
        assert str(exc.value).startswith(f"unknown {area} '{theirs.upper()}' ({what} is '{ours}' here); choose one of: ")
    with pytest.raises(ConfigError) as exc:
        rlhf_pm.components.get(AdvantageEstimator, "grpo_passk")
    assert str(exc.value).startswith("unknown advantage estimator 'grpo_passk'; choose one of: ")


class Clash:
    @hookimpl
    def rlhf_advantage_estimators(self):
        yield AdvantageEstimator("rloo", compute=lambda x: x)


def test_same_name_from_two_plugins_names_both(rlhf_pm):
    with registered(rlhf_pm, Clash(), "mine"):
        with pytest.raises(PluginError, match="'rloo' is provided by both plugin 'advantages' and plugin 'mine'"):
            _ = rlhf_pm.components
    assert "rloo" in rlhf_pm.components.names(AdvantageEstimator)  # unregistered again


class TwoEngines:
    """One plugin implementing one registration hook twice (``specname``), as a plugin offering two
    backends from two functions does."""

    @hookimpl(specname="rlhf_generation_backends")
    def counting(self):
        yield GenerationBackend("acme_counting", factory=lambda ctx: None)

    @hookimpl(specname="rlhf_generation_backends")
    def echo(self):
        yield GenerationBackend("acme_echo", factory=lambda ctx: None)


def test_one_plugin_implementing_a_hook_twice_is_collected_once_not_a_clash_with_itself(rlhf_pm):
    with registered(rlhf_pm, TwoEngines(), "acme"):
        reg = rlhf_pm.components
        assert {"acme_counting", "acme_echo"} <= set(reg.names(GenerationBackend))
        assert reg.provider(GenerationBackend, "acme_echo") == reg.provider(GenerationBackend, "acme_counting") == "acme"


def test_registered_unregisters_even_when_the_block_fails(rlhf_pm):
    plugin = Clash()
    with pytest.raises(RuntimeError):
        with registered(rlhf_pm, plugin, "mine"):
            raise RuntimeError("boom")
    assert not rlhf_pm.is_registered(plugin)


def test_unavailable_component_names_the_extra(rlhf_pm):
    class Needs:
        @hookimpl
        def rlhf_generation_backends(self):
            yield GenerationBackend("fancy", factory=dict, requires=("no_such_module_xyz",), extra="vllm")

    with registered(rlhf_pm, Needs(), "needs"):
        comp = rlhf_pm.components.get(GenerationBackend, "fancy", require_available=False)
        assert not comp.available
        with pytest.raises(ConfigError, match=r"needs no_such_module_xyz.*pip install 'rlhf-plugins\[vllm\]'"):
            rlhf_pm.components.get(GenerationBackend, "fancy")


def test_wrong_type_from_registration_hook(rlhf_pm):
    class Wrong:
        @hookimpl
        def rlhf_reward_functions(self):
            yield AdvantageEstimator("oops", compute=len)

    with registered(rlhf_pm, Wrong(), "wrong"):
        with pytest.raises(PluginError, match="plugin 'wrong' returned AdvantageEstimator from rlhf_reward_functions"):
            _ = rlhf_pm.components


def test_invalid_component_name():
    with pytest.raises(ValueError, match="invalid reward function name 'Bad Name'"):
        RewardFunction("Bad Name", lambda prompts, completions, **k: [])


def test_unmarked_rlhf_function_is_a_hook_and_typos_are_caught(tmp_path):
    ok = tmp_path / "unmarked.py"
    ok.write_text(textwrap.dedent("""
        from rlhf_plugins import RewardFunction
        def rlhf_reward_functions():
            yield RewardFunction("unmarked", lambda prompts, completions, **kw: [0.0] * len(completions))
    """))
    pm = create_manager([str(ok)], autoload=False)
    assert pm.components.provider(RewardFunction, "unmarked") == "unmarked"

    typo = tmp_path / "typo.py"
    typo.write_text("def rlhf_reward_functionz():\n    return []\n")
    with pytest.raises(PluginError, match="rlhf_reward_functionz"):
        create_manager([str(typo)], autoload=False)


def test_plugin_from_module_file_and_block(tmp_path, monkeypatch):
    pkg = tmp_path / "mod_plugin_abc.py"
    pkg.write_text("def thing(prompts, completions, **kwargs):\n    return [1.0] * len(completions)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    pm = create_manager(["mod_plugin_abc"], autoload=False)
    assert pm.components.provider(RewardFunction, "thing") == "mod_plugin_abc"
    assert pm.infos["mod_plugin_abc"].source == "--plugin"
    pm = create_manager(["no:advantages"], autoload=False)
    assert pm.components.names(AdvantageEstimator) == []
    assert pm.is_blocked("advantages")


def test_plugin_errors(tmp_path):
    with pytest.raises(PluginError, match="unknown plugin 'nope_not_here'"):
        create_manager(["nope_not_here"], autoload=False)
    with pytest.raises(PluginError, match="plugin file 'missing.py' does not exist"):
        create_manager(["missing.py"], autoload=False)
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_real_module_qq\n")
    with pytest.raises(PluginError, match=r"plugin '.*broken.py' failed to import: ModuleNotFoundError"):
        create_manager([str(broken)], autoload=False)
    empty = tmp_path / "empty.py"
    empty.write_text("X = 1\n")
    with pytest.raises(PluginError, match="defines no rlhf_\\* hooks, no reward function"):
        create_manager([str(empty)], autoload=False)


def _fake_distribution(tmp_path, name, module_source, ep_name):
    site = tmp_path / f"site_{name}"
    site.mkdir()
    (site / f"{name}.py").write_text(module_source)
    info = site / f"{name}-1.2.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.2.3\n")
    (info / "entry_points.txt").write_text(f"[rlhf_plugins]\n{ep_name} = {name}\n")
    return site


def test_entry_points_autoload_and_broken_one_warns(tmp_path, monkeypatch):
    good = _fake_distribution(
        tmp_path, "good_ep_plugin",
        "from rlhf_plugins import RewardFunction, hookimpl\n"
        "@hookimpl\ndef rlhf_reward_functions():\n"
        "    yield RewardFunction('from_ep', lambda prompts, completions, **k: [0.0] * len(completions))\n",
        "goodep",
    )
    bad = _fake_distribution(tmp_path, "bad_ep_plugin", "raise RuntimeError('kaput')\n", "badep")
    monkeypatch.syspath_prepend(str(good))
    monkeypatch.syspath_prepend(str(bad))
    monkeypatch.delenv("RLHF_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    pm = create_manager()
    assert pm.components.provider(RewardFunction, "from_ep") == "goodep"
    assert pm.infos["goodep"].source == "entry point"
    assert pm.infos["goodep"].version == "1.2.3"
    assert any("'badep' from distribution bad_ep_plugin 1.2.3 failed to import" in w for w in pm.warnings)

    # asked for by name, the broken one is a hard error
    with pytest.raises(PluginError, match="plugin 'badep' .* failed to import: RuntimeError: kaput"):
        create_manager(["badep"], autoload=False)

    # autoload off: only named entry points load; "0", "false", "no", "off" or empty leave it on
    for value in ("0", "false", "No", "off", ""):
        monkeypatch.setenv("RLHF_DISABLE_PLUGIN_AUTOLOAD", value)
        assert create_manager().has_plugin("goodep"), value
    monkeypatch.setenv("RLHF_DISABLE_PLUGIN_AUTOLOAD", "1")
    pm = create_manager()
    assert not pm.has_plugin("goodep")
    pm = create_manager(["goodep"])
    assert pm.has_plugin("goodep")
    assert "from_ep" in pm.components.names(RewardFunction)
    # blocked entry point is not loaded
    monkeypatch.delenv("RLHF_DISABLE_PLUGIN_AUTOLOAD")
    pm = create_manager(["no:goodep", "no:badep"])
    assert not pm.has_plugin("goodep") and not pm.warnings


def test_lifecycle_observer_failure_is_a_warning(rlhf_pm):
    seen = []

    class Bad:
        @hookimpl
        def rlhf_after_step(self, step, metrics):
            raise ValueError("observer broke")

    class Good:
        @hookimpl
        def rlhf_after_step(self, step, metrics):
            seen.append((step, dict(metrics)))

    with registered(rlhf_pm, Bad(), "bad"), registered(rlhf_pm, Good(), "good"):
        rlhf_pm.notify("rlhf_after_step", step=3, metrics={"x": 1.0})
    assert seen == [(3, {"x": 1.0})]
    assert rlhf_pm.warnings == ["plugin 'bad' failed in rlhf_after_step: ValueError: observer broke"]


def test_a_lifecycle_wrapper_sees_every_call_and_the_observers_results(rlhf_pm):
    """Observers are called through pluggy: a new-style wrapper runs around all of them."""
    order = []

    class Timer:
        @hookimpl(wrapper=True)
        def rlhf_after_step(self, step, metrics):
            order.append("before")
            result = yield
            order.append(("after", len(result)))
            return result

    class Observer:
        @hookimpl
        def rlhf_after_step(self, step, metrics):
            order.append(("observed", step))

    class Broken:
        @hookimpl
        def rlhf_after_step(self, step, metrics):
            raise KeyError("x")

    with registered(rlhf_pm, Timer(), "timer"), registered(rlhf_pm, Observer(), "obs"), \
            registered(rlhf_pm, Broken(), "broken"):
        rlhf_pm.notify("rlhf_after_step", step=7, metrics={})
    assert order == ["before", ("observed", 7), ("after", 0)]
    assert rlhf_pm.warnings == ["plugin 'broken' failed in rlhf_after_step: KeyError: 'x'"]


def test_sys_exit_in_an_observer_is_an_error_naming_the_plugin(rlhf_pm):
    import sys

    from rlhf_plugins.errors import PluginError

    class Quits:
        @hookimpl
        def rlhf_after_step(self, step, metrics):
            sys.exit(0)

    with registered(rlhf_pm, Quits(), "quits"), pytest.raises(PluginError, match=r"plugin 'quits' called sys.exit\(0\) in rlhf_after_step"):
        rlhf_pm.notify("rlhf_after_step", step=1, metrics={})


def test_hook_recorder_sees_registration_set_up_decision_and_lifecycle_hooks(tiny_model):
    from rlhf_plugins.config import OptionRegistry
    from rlhf_plugins.config.schema import Config
    from rlhf_plugins.core.manager import create_manager

    pm = create_manager(autoload=False)
    with record_hooks(pm) as rec:
        assert "ppo" in pm.components.names(PolicyLoss)
        pm.add_options(OptionRegistry())
        pm.load_model("reference", tiny_model, Config())
        pm.notify("rlhf_after_weight_sync", step=1, info={"tensors": 3})
    names = rec.names()
    # registration hooks are collected plugin by plugin: one call per implementing plugin
    assert names.count("rlhf_policy_losses") == 1 and names.count("rlhf_weight_sync_methods") == 3
    assert names[-3:] == ["rlhf_add_options", "rlhf_load_model", "rlhf_after_weight_sync"]
    assert rec.of("rlhf_load_model")[0]["role"] == "reference"


def test_load_model_wrapper_can_change_the_model(rlhf_pm, tiny_model):
    from rlhf_plugins.config.schema import Config

    class Wrap:
        @hookimpl(wrapper=True)
        def rlhf_load_model(self, role, path, config):
            model = yield
            model.wrapped_for = role
            return model

    with registered(rlhf_pm, Wrap(), "wrap"):
        model = rlhf_pm.load_model("actor", tiny_model, Config())
    assert model.wrapped_for == "actor"
    assert sum(p.numel() for p in model.parameters()) > 100_000


def test_no_heavy_import_on_plugin_listing():
    import subprocess

    code = (
        "import sys; from rlhf_plugins.core.manager import create_manager; pm = create_manager(); "
        "_ = list(pm.components); from rlhf_plugins.cli import main; "
        "heavy = [m for m in ('torch', 'ray', 'vllm', 'deepspeed', 'transformers', 'trl', 'peft') if m in sys.modules]; "
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_an_installed_reward_plugin_never_changes_what_a_plain_run_trains_on(rlhf, tmp_path, monkeypatch):
    """Installed (auto-loaded) packages that provide rewards are listed, not used: the task's reward
    stays the default; the same package's reward is used when the run asks for the plugin by name."""
    import yaml

    site = _fake_distribution(
        tmp_path, "acme_rewards",
        "from rlhf_plugins import RewardFunction, hookimpl\n"
        "@hookimpl\ndef rlhf_reward_functions():\n"
        "    yield RewardFunction('acme_length', lambda prompts, completions, **k: [len(c) for c in completions])\n",
        "acme",
    )
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delenv("RLHF_DISABLE_PLUGIN_AUTOLOAD")
    code, out, err = rlhf("train", "--dry-run")
    assert code == 0, err
    assert yaml.safe_load(out[out.index("model:"):out.index("installed plugins")])["reward"]["functions"] == ["exact_match"]
    assert "installed plugins loaded: acme 1.2.3 (acme_rewards 1.2.3)" in out
    from rlhf_plugins.api import prepare

    assert prepare({})[2].rewards == ["exact_match"]
    assert prepare({}, plugins=["acme"])[2].rewards == ["acme_length"]
