"""Every contract is written where it is used: each method or attribute the loop, the roles and
the sync methods use on a placement, a learner, an engine, a sync method, a role handle or a model
worker is a method of its protocol or one of its documented optional methods; and every field of
the data types a plugin receives is documented."""
from __future__ import annotations

import ast
import dataclasses
import inspect
import re

import pytest

import rlhf_plugins
from rlhf_plugins import protocols
from tests.helpers import ROOT

PKG = ROOT / "rlhf_plugins"
OPTIONAL = protocols.OPTIONAL


def methods(contract: type) -> set[str]:
    """Public names a protocol declares (methods, properties, annotated attributes)."""
    return {n for n in vars(contract) if not n.startswith("_")} | set(getattr(contract, "__annotations__", {}))


def role_methods() -> set[str]:
    """What a role handle offers besides run/endpoints: the methods of the role classes."""
    from rlhf_plugins.training import reward_role, roles

    out: set[str] = set()
    for module in (roles, reward_role):
        for cls in vars(module).values():
            if inspect.isclass(cls) and issubclass(cls, roles.Role):
                out |= {n for n in dir(cls) if not n.startswith("_")}
    return out


def rules() -> list[tuple[str, set[str], set[str]]]:
    """(modules, receivers, what they may use): the call sites of each contract."""
    handle = methods(protocols.RoleHandle) | set(OPTIONAL["role_handle"]) | role_methods()
    roles = {f"{who}.{role}" for who in ("self", "trainer") for role in ("actor", "engine", "critic", "reference",
                                                                         "reward")}
    engine, learner = set(OPTIONAL["engine"]), set(OPTIONAL["learner"])
    return [
        ("training/*.py", {"self.placement", "trainer.placement", "placement"},
         methods(protocols.Placement) | set(OPTIONAL["placement"]) | {"max_restarts"}),
        ("training/roles.py", {"self.learner"}, methods(protocols.Learner) | learner),
        ("training/roles.py", {"self.engine"}, methods(protocols.GenerationEngine) | engine),
        ("training/loop.py", {"self.sync"}, methods(protocols.WeightSync) | set(OPTIONAL["sync"])),
        ("sync/*.py", {"actor", "engine"}, handle),
        ("training/[!r]*.py", roles, handle),  # every training module but roles.py (whose self.engine is the engine)
        ("sync/*.py", {"worker"}, methods(protocols.ModelWorker) | set(OPTIONAL["model_worker"])),
        ("sync/*.py", {"ctx.backend"}, methods(protocols.Learner) | methods(protocols.GenerationEngine) | engine
         | learner),
        ("sync/*.py", {"ctx"}, {f.name for f in dataclasses.fields(protocols.RankContext)}),
    ]


def uses(source: str):
    """(receiver, name, line) for every ``receiver.name`` and ``getattr(receiver, "name")``."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            yield ast.unparse(node.value), node.attr, node.lineno
        elif (isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr")
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)):
            yield ast.unparse(node.args[0]), node.args[1].value, node.lineno


def unwritten(source: str, receivers: set[str], allowed: set[str]) -> list[str]:
    return [f"{line}: {r}.{name}" for r, name, line in uses(source) if r in receivers and name not in allowed]


def test_every_use_of_a_contract_is_written_in_its_protocol():
    found, sites = [], 0
    for pattern, receivers, allowed in rules():
        for path in sorted(PKG.glob(pattern)):
            source = path.read_text()
            sites += sum(r in receivers for r, _, _ in uses(source))
            found += [f"{path.relative_to(ROOT)}:{u}" for u in unwritten(source, receivers, allowed)]
    assert not found, "used but not in the protocol nor in protocols.OPTIONAL:\n" + "\n".join(found)
    assert sites > 60  # the walk reaches the call sites (74 when written)


def test_the_walk_sees_a_method_the_protocol_lacks():
    source = "def f(trainer):\n    if getattr(trainer.placement, 'rewind', None):\n        trainer.placement.drain()\n"
    allowed = methods(protocols.Placement) | set(OPTIONAL["placement"])
    assert unwritten(source, {"trainer.placement"}, allowed) == ["2: trainer.placement.rewind",
                                                                 "3: trainer.placement.drain"]
    assert unwritten("def f(placement):\n    placement.ready()\n", {"placement"}, allowed) == []


def test_every_optional_method_is_described_where_its_protocol_is():
    text = inspect.getsource(protocols)
    for area, names in OPTIONAL.items():
        for name in names:
            assert re.search(rf"``{name}\(", text), f"protocols.py never describes optional {area} method {name}()"


DATA_TYPES = ["AdvantageInputs", "PolicyLossInputs", "Rollout", "SamplingParams", "Samples", "BackendContext",
              "PlacementContext", "RankContext", "ModelShape", "MemoryInputs"]


def documented_sections() -> dict[str, str]:
    text = (ROOT / "docs" / "data_types.md").read_text()
    parts = re.split(r"^## (\w+)\n", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


@pytest.mark.parametrize("name", DATA_TYPES)
def test_every_field_of_a_plugin_data_type_is_documented(name):
    cls = getattr(rlhf_plugins, name)
    section = documented_sections().get(name)
    assert section is not None, f"docs/data_types.md has no '## {name}'"
    names = [f.name for f in dataclasses.fields(cls)]
    names += [n for n, v in vars(cls).items() if not n.startswith("_") and n not in names
              and (callable(v) or isinstance(v, (property, classmethod, staticmethod)))]
    missing = [n for n in names if f"`{n}" not in section]
    assert not missing, f"docs/data_types.md '## {name}' lacks {missing}"
    listed = set(re.findall(r"^- `(\w+)", section, flags=re.M))
    assert listed <= set(names) | {"vocab"}, f"'## {name}' lists what {name} lacks: {listed - set(names)}"


@pytest.mark.parametrize("cls", ["PlacementStrategy", "GenerationBackend", "LearnerBackend", "WeightSyncMethod",
                                 "Environment"])
def test_every_registration_field_is_documented(cls):
    from rlhf_plugins import types

    component = getattr(types, cls)
    doc = "environments.md" if cls == "Environment" else "backends.md"
    text = (ROOT / "docs" / doc).read_text()
    base = {f.name for f in dataclasses.fields(types.Component)}
    missing = [f.name for f in dataclasses.fields(component) if f.name not in base and f"{f.name}=" not in text
               and f.name != "factory"]
    assert not missing, f"docs/{doc} lacks {cls} fields {missing}"
