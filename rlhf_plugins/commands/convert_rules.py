"""Flags of an OpenRLHF PPO command that OpenRLHF itself ignores in the run the rest of the command makes:
left out of the converted config (which rlhf would refuse, saying the setting has no effect) and listed as
not converted, with the reason."""
from __future__ import annotations

from typing import Any


def drop_what_openrlhf_ignores(out: Any) -> None:
    """``out``: the :class:`~rlhf_plugins.commands.convert.Converted` of a PPO command, defaults carried."""
    _frozen_without_critic(out)
    _unbiased_gradient_without_kl_loss(out)


def _frozen_without_critic(out: Any) -> None:
    """``--freezing_actor_steps`` trains the critic alone for a while; without a critic (a group estimator)
    OpenRLHF skips the actor's updates with nothing else training, which rlhf refuses: not converted."""
    critic = out.raw.get("critic", {})
    if critic.get("freezing_steps") and out.raw["algo"]["advantage"]["estimator"] != "gae":
        del critic["freezing_steps"]
        out.skipped.append(("--freezing_actor_steps", f"no critic to train alone under estimator "
                                                      f"'{out.raw['algo']['advantage']['estimator']}' (OpenRLHF would "
                                                      "skip the actor's updates with nothing training)"))


def _unbiased_gradient_without_kl_loss(out: Any) -> None:
    """``--algo.kl.unbiased_gradient`` shapes the KL loss term's gradient; OpenRLHF reads it only with
    ``--algo.kl.use_loss`` (``--use_kl_loss``): with KL in the reward it changes nothing there."""
    kl = out.raw.get("algo", {}).get("kl", {})
    if kl.get("unbiased_gradient") and kl.get("in_reward", False):
        del kl["unbiased_gradient"]
        out.skipped.append(("--algo.kl.unbiased_gradient", "KL is in the reward (no --algo.kl.use_loss), where "
                                                           "OpenRLHF ignores it"))
