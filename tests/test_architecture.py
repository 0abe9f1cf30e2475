"""The shape of the package: folders import each other without cycles, nothing below the entry
points imports them, builtin code decides by capabilities (never by another plugin's name), and
the backend contracts are documented as written."""
from __future__ import annotations

import ast
import inspect
import re
import sys
from collections import defaultdict
from pathlib import Path

import pytest

import rlhf_plugins
from rlhf_plugins import protocols
from tests.helpers import ROOT

PKG = ROOT / "rlhf_plugins"
#: the entry points: nothing else may import them
TOP = {"rlhf_plugins.api", "rlhf_plugins.cli", "rlhf_plugins.training.run"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def runtime_nodes(tree: ast.AST):
    """Every node except those under ``if TYPE_CHECKING:`` (type hints import nothing at run time)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            continue
        yield node
        yield from runtime_nodes(node)


def imports_of(path: Path) -> set[str]:
    """Every rlhf_plugins module ``path`` imports, at module level or inside functions."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("rlhf_plugins"):
                out.add(target)
                out.update(f"{target}.{a.name}" for a in node.names)  # "from pkg import module"
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("rlhf_plugins"))
    modules = {module_name(p) for p in PKG.rglob("*.py")}
    return {m for m in out if m in modules and m != name}


def node_of(module: str) -> str:
    """The unit of the layering: a folder, or a module at the package root."""
    parts = module.split(".")
    if len(parts) == 1:
        return "rlhf_plugins (exports)"
    return parts[1] if len(parts) > 2 or (PKG / parts[1]).is_dir() else module


GRAPH: dict[str, set[str]] = {module_name(p): imports_of(p) for p in PKG.rglob("*.py")}


def test_no_import_cycles_between_folders():
    edges: dict[str, set[str]] = defaultdict(set)
    for module, targets in GRAPH.items():
        for target in targets:
            a, b = node_of(module), node_of(target)
            if a != b:
                edges[a].add(b)
    # a cycle is a node reachable from itself
    for start in list(edges):
        seen, stack = set(), list(edges[start])
        while stack:
            node = stack.pop()
            assert node != start, f"import cycle through {start}: {sorted(edges[start])}"
            if node not in seen:
                seen.add(node)
                stack.extend(edges.get(node, ()))


def module_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Groups of modules that import each other, directly or around a circle (at run time, also
    inside functions; imports for type hints only are not edges)."""
    def reach(start: str) -> set[str]:
        seen, stack = set(), list(graph.get(start, ()))
        while stack:
            node = stack.pop()
            if node not in seen:
                seen.add(node)
                stack.extend(graph.get(node, ()))
        return seen

    reachable = {m: reach(m) for m in graph}
    groups = {frozenset(m2 for m2 in reachable[m] if m in reachable.get(m2, ())) for m in graph if m in reachable[m]}
    return sorted(sorted(g) for g in groups)


def test_no_module_imports_itself_around_a_circle():
    # a package's __init__ re-exporting its modules is not a circle of code
    graph = {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in GRAPH.items()}
    assert module_cycles(graph) == []


def test_the_cycle_check_sees_a_circle():
    assert module_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_nothing_below_the_entry_points_imports_them():
    allowed = {"rlhf_plugins.cli", "rlhf_plugins.api", "rlhf_plugins.integrations.trl"}
    for module, targets in GRAPH.items():
        if module in allowed or module.startswith("rlhf_plugins.commands"):  # the CLI's own subcommands
            continue
        assert not targets & TOP, f"{module} imports {sorted(targets & TOP)}"
    assert "rlhf_plugins.training.run" not in GRAPH["rlhf_plugins.integrations.trl"]  # the public API only


COMPARED = re.compile(
    r"config\.(?:generation\.backend|learner\.backend|placement\.strategy|sync\.method|algo\.advantage\.estimator|"
    r"algo\.policy_loss\.name|algo\.kl\.estimator)\s*(?:==|!=|in\b|not in\b)"
    r"|(?:==|!=)\s*config\.(?:generation\.backend|learner\.backend|placement\.strategy|sync\.method)"
)


def test_builtin_code_never_compares_config_with_a_component_name():
    offenders = []
    for path in PKG.rglob("*.py"):
        if "builtin_plugins" in path.parts:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if COMPARED.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not offenders, offenders


def test_the_checker_sees_a_comparison():
    assert COMPARED.search('if config.sync.method == "adapter":')
    assert COMPARED.search('if config.placement.strategy != "ray":')
    assert not COMPARED.search("sync_name = c.sync.method or placement.default_sync")


def test_ruff_finds_nothing():
    """The lint rules of pyproject.toml ([tool.ruff]) hold for the package, tests, benchmarks and examples."""
    proc = _ruff("check", "--show-files", "rlhf_plugins", "tests", "bench", "examples", "scripts")
    checked = {Path(line).relative_to(ROOT).parts[0] for line in proc.stdout.splitlines() if line.endswith(".py")}
    assert {"rlhf_plugins", "tests", "bench", "examples"} <= checked, checked  # every Python tree is looked at
    proc = _ruff("check", "rlhf_plugins", "tests", "bench", "examples", "scripts")
    assert proc.returncode == 0, proc.stdout[-3000:]


def test_the_ruff_rules_see_an_unused_import_and_a_long_line(tmp_path):
    """The check above can fail: the project's rule set flags what it is configured to flag."""
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n\nX = " + "1 + " * 40 + "1\n")
    proc = _ruff("check", "--config", str(ROOT / "pyproject.toml"), "--no-cache", str(bad))
    assert proc.returncode == 1 and "F401" in proc.stdout and "E501" in proc.stdout, proc.stdout


def _ruff(*args: str):
    import shutil
    import subprocess

    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    return subprocess.run([ruff, *args], cwd=ROOT, capture_output=True, text=True)


#: STYLE.md: a module of about 300 lines is one idea; a function longer than a screen hides several
MODULE_LINES, FUNCTION_LINES = 300, 60


def long_parts(path: Path, base: Path = ROOT) -> list[tuple[str, int]]:
    """(what, lines) for the module itself and each function in it over the limits."""
    text, name = path.read_text(), path.relative_to(base)
    out = [(str(name), n)] if (n := len(text.splitlines())) > MODULE_LINES else []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if (n := node.end_lineno - node.lineno + 1) > FUNCTION_LINES:
                out.append((f"{name}:{node.lineno} {node.name}()", n))
    return out


def test_no_module_or_function_is_asking_to_be_split():
    long = [part for p in PKG.rglob("*.py") for part in long_parts(p)]
    assert not long, long


def test_the_size_guard_sees_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(FUNCTION_LINES))
    (tmp_path / "long.py").write_text(f"def f():\n{body}\n")
    assert long_parts(tmp_path / "long.py", tmp_path) == [("long.py:1 f()", FUNCTION_LINES + 1)]
    (tmp_path / "long.py").write_text("x = 1\n" * (MODULE_LINES + 1))
    assert long_parts(tmp_path / "long.py", tmp_path) == [("long.py", MODULE_LINES + 1)]


CONTRACTS = [protocols.GenerationEngine, protocols.Learner, protocols.Placement, protocols.WeightSync,
             protocols.RoleHandle, protocols.Endpoint, protocols.ModelWorker]


def methods(contract: type) -> dict[str, str]:
    out = {}
    for name, fn in vars(contract).items():
        if name.startswith("_") or not callable(fn):
            continue
        sig = str(inspect.signature(fn)).replace("'", "")
        out[name] = f"{name}{sig}"
    return out


@pytest.mark.parametrize("contract", CONTRACTS, ids=[c.__name__ for c in CONTRACTS])
def test_every_contract_method_is_documented_with_its_signature(contract):
    docs = (ROOT / "docs" / "backends.md").read_text()
    for sig in methods(contract).values():
        assert f"`{sig}`" in docs, f"docs/backends.md lacks `{sig}` ({contract.__name__})"


def test_every_optional_method_is_documented():
    docs = (ROOT / "docs" / "backends.md").read_text()
    for area, optional in protocols.OPTIONAL.items():
        for name in optional:
            assert f"`{name}(" in docs, f"docs/backends.md lacks optional {area} method {name}"


def test_every_exported_name_exists_and_import_is_cheap():
    for name in rlhf_plugins.__all__:
        assert getattr(rlhf_plugins, name) is not None, name
    import subprocess
    import sys

    code = "import sys, rlhf_plugins; print(sorted(m for m in ('torch', 'ray', 'vllm', 'deepspeed') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
