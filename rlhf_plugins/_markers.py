"""The ``rlhf`` project markers shared by hookspecs, plugins and the manager."""
from __future__ import annotations

import pluggy

PROJECT = "rlhf"
ENTRY_POINT_GROUP = "rlhf_plugins"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)
