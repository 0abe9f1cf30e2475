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


@pytest.mark.parametrize("name, fn", HOOKS, ids=[h[0] for h in HOOKS])
def test_every_hook_is_exercised_by_a_test(name, fn):
    tests = "".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py") if p.name != "test_hookspecs.py")
    sources = tests + (ROOT / "examples" / "my_reward" / "my_reward" / "__init__.py").read_text()
    assert name in sources, f"no test mentions {name}"
