"""Hook specifications of rlhf-plugins: the whole plugin API.

* :mod:`.registration` -- one collecting hook per area of the RL loop; each yields
  frozen dataclasses from :mod:`rlhf_plugins.types`.
* :mod:`.configuration` -- historic set-up hooks: add config sections, see the final config.
* :mod:`.decision` -- first-result hooks: load the model of a role.
* :mod:`.lifecycle` -- observers of the run: after rollout, step, weight sync, on error, after train.
* :mod:`.state` -- a plugin's own state in checkpoints and on resume.
"""
from __future__ import annotations

from . import configuration, decision, lifecycle, registration, state

SPEC_MODULES = (registration, configuration, decision, lifecycle, state)

__all__ = ["SPEC_MODULES", "configuration", "decision", "lifecycle", "registration", "state"]
