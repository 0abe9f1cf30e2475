"""What the README's base install (``pip install rlhf-plugins``, no extras) must carry: every package
rlhf-plugins' own code imports on the main path (`rlhf train` on the built-in default, with its
evaluation and final save) is a base requirement or comes with one. CI installs every extra, so a
missing declaration passes CI and fails a new user (accelerate, 2026-11-26); this test sees it."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = """
import builtins, json, sys
direct = set()
real_import = builtins.__import__

def recording(name, globals=None, locals=None, fromlist=(), level=0):
    if level == 0 and globals and str(globals.get("__name__", "")).startswith("rlhf_plugins"):
        direct.add(name.split(".")[0])
    return real_import(name, globals, locals, fromlist, level)

builtins.__import__ = recording
from rlhf_plugins.cli import main
code = main(["train", "--train.steps", "2", "--train.progress", "false", "--train.run_name", "deps"])
print("IMPORTS " + json.dumps({"code": code, "direct": sorted(direct)}))
"""


def declared() -> list[str]:
    """``install_requires`` of setup.cfg: what ``pip install rlhf-plugins`` installs (the file, not the
    installed metadata, which an editable install leaves as it was when installed)."""
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(Path(__file__).resolve().parent.parent / "setup.cfg")
    return [line.strip() for line in cfg["options"]["install_requires"].splitlines() if line.strip()]


def base_closure() -> set[str]:
    """The base requirements and theirs without extras, recursively (normalised names)."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    todo, seen = [Requirement(line).name for line in declared()], {"rlhf-plugins"}
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for line in requires:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def test_every_package_the_main_path_imports_is_a_base_requirement(tmp_path):
    from importlib import metadata

    from packaging.utils import canonicalize_name

    run = subprocess.run([sys.executable, "-c", SCRIPT], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                         env={**__import__("os").environ, "RLHF_DISABLE_PLUGIN_AUTOLOAD": "1"})
    line = [x for x in run.stdout.splitlines() if x.startswith("IMPORTS ")]
    assert run.returncode == 0 and line, run.stderr[-2000:]
    result = json.loads(line[-1].removeprefix("IMPORTS "))
    assert result["code"] == 0
    modules = set(result["direct"]) - set(sys.stdlib_module_names) - {"rlhf_plugins", "__future__"}
    owners = metadata.packages_distributions()
    closure = base_closure()
    assert {"torch", "transformers", "accelerate"} <= {m for m in modules}  # the recording saw the main path
    undeclared = {m: owners.get(m) for m in modules
                  if not any(canonicalize_name(d) in closure for d in owners.get(m, []))}
    assert not undeclared, f"imported on the main path but not installed by `pip install rlhf-plugins`: {undeclared}"
