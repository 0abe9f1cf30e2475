"""Every hook is documented with its exact signature, has a full docstring and a test."""
from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from rlhf_plugins.hookspecs import SPEC_MODULES

ROOT = Path(__file__).resolve().parent.parent
HOOKS = [(name, fn) for m in SPEC_MODULES for name, fn in vars(m).items() if name.startswith("rlhf_") and callable(fn)]


def signature(fn) -> str:
    return fn.__name__ + str(inspect.signature(fn)).replace("'", "")


@pytest.mark.parametrize("name, fn", HOOKS, ids=[h[0] for h in HOOKS])
def test_hook_is_documented_with_its_signature(name, fn):
    docs = (ROOT / "docs" / "plugin_hooks.md").read_text()
    assert f"`{signature(fn)}" in docs, f"docs/plugin_hooks.md lacks `{signature(fn)}`"


@pytest.mark.parametrize("name, fn", HOOKS, ids=[h[0] for h in HOOKS])
def test_hook_docstring_is_a_reference(name, fn):
    doc = inspect.getdoc(fn) or ""
    assert "Example" in doc and "@hookimpl" in doc, f"{name} needs an example"
    assert "Called" in doc or "called" in doc, f"{name} must say when it is called"


def every_hook_plugin(log: Path) -> str:
    """A plugin file implementing every hook: each call appends the hook's name to ``log``;
    registration hooks register nothing, state hooks keep a counter, the others have no opinion.
    Once ``log`` + ``.fail`` exists its rollout hook raises, so the error hook is called too."""
    lines = ["import os", "from rlhf_plugins import hookimpl", f"LOG = {str(log)!r}",
             "def _seen(name):", "    with open(LOG, 'a') as f:", "        f.write(name + '\\n')"]
    for name, fn in HOOKS:
        params = ", ".join(inspect.signature(fn).parameters)
        body = {"rlhf_state_dict": "return {'saved': 1}",
                "rlhf_rollout": "if os.path.exists(LOG + '.fail'):\n        raise RuntimeError('stop here')"
                }.get(name, "return None")
        if name in REGISTRATION:
            body = "return []"
        lines += ["@hookimpl", f"def {name}({params}):", f"    _seen({name!r})", f"    {body}"]
    return "\n".join(lines) + "\n"


REGISTRATION = {n for n, fn in HOOKS if fn.__module__.endswith("registration")}


def test_every_hook_is_called_by_the_runs_that_need_it(rlhf, tmp_path):
    """Asynchronous training with held-out evaluation and checkpoints, resumed, then failing:
    together these call every hook of the plugin API."""
    from tests.helpers import the_run, with_eval

    log, plugin = tmp_path / "calls.txt", tmp_path / "every_hook.py"
    plugin.write_text(every_hook_plugin(log))
    code, _, err = rlhf("train", "--plugin", str(plugin), "--train.max_staleness", "1",
                        "--train.allow_uncorrected_staleness", "true", "--train.save_every", "1",
                        "--train.log_samples_every", "2", *with_eval("--train.steps", "3"))
    assert code == 0, err
    first = set(log.read_text().split())
    Path(f"{log}.fail").touch()
    code, _, err = rlhf("train", "--resume", str(the_run()), "--train.steps", "4")
    # a decision hook that raises is one line naming the plugin and the hook
    assert code == 2 and "plugin 'every_hook' raised RuntimeError in rlhf_rollout: stop here" in err, err
    called = set(log.read_text().split())
    assert called == {name for name, _ in HOOKS}, sorted({name for name, _ in HOOKS} - called)
    assert "rlhf_load_state_dict" not in first and "rlhf_on_error" not in first  # each came from its cause
