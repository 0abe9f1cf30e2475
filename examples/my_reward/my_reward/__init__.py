"""An rlhf-plugins plugin: partial credit for numeric answers.

Installed, it is picked by its entry-point name: ``rlhf train --plugin my_reward``.
It adds the reward function ``closeness`` and a config section ``closeness``
(``--closeness.scale 5``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import partial

from rlhf_plugins import RewardFunction, hookimpl

__version__ = "0.1.0"

_NUMBER = re.compile(r"-?\d+")


@dataclass
class ClosenessOptions:
    #: an answer this far from the label (or farther) scores 0
    scale: float = 10.0


def closeness(prompts, completions, label, scale=10.0, **kwargs):
    """1 - |answer - label| / scale, clipped at 0; 0 when the completion has no number."""
    scores = []
    for completion, target in zip(completions, label):
        found = _NUMBER.search(completion)
        if found is None:
            scores.append(0.0)
        else:
            scores.append(max(0.0, 1.0 - abs(int(found.group()) - int(target)) / scale))
    return scores


@hookimpl
def rlhf_add_options(options):
    options.add_section("closeness", ClosenessOptions)


@hookimpl
def rlhf_reward_functions():
    yield RewardFunction(
        "closeness",
        factory=lambda config: partial(closeness, scale=config.section("closeness").scale),
        description="partial credit: 1 - |answer - label| / scale",
    )
