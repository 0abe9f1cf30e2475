"""State hooks: a plugin that keeps state across steps (a curriculum sampler, a running
statistic) puts it in every checkpoint and gets it back on resume, without editing the core.

Both are called plugin by plugin; what a plugin returns from ``rlhf_state_dict`` is stored under
its name and handed back to that plugin only.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .._markers import hookspec


@hookspec
def rlhf_state_dict() -> Mapping[str, Any] | None:
    """Return this plugin's state for a checkpoint (JSON-serialisable: numbers, strings, lists,
    dicts), or ``None`` when it keeps none.

    Called at every checkpoint, in the driver, after the step it follows. Example::

        @hookimpl
        def rlhf_state_dict():
            return {"level": CURRICULUM.level}
    """


@hookspec
def rlhf_load_state_dict(state: Mapping[str, Any]) -> None:
    """Restore what ``rlhf_state_dict`` returned, when a run resumes from a checkpoint (before the
    first resumed step). Not called for a plugin that saved nothing. Example::

        @hookimpl
        def rlhf_load_state_dict(state):
            CURRICULUM.level = state["level"]
    """
