"""Set-up hooks: plugins extend the config and see the final one.

Both are *historic*: a plugin registered after the call (a late ``--plugin``)
is still called with the same arguments when it registers.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .._markers import hookspec

if TYPE_CHECKING:
    from ..config.options import OptionRegistry
    from ..config.schema import Config
    from ..config.validate import Plan


@hookspec(historic=True)
def rlhf_add_options(options: OptionRegistry) -> None:
    """Add a typed config section, settable from YAML and dotted CLI flags.

    Called once while the config schema is built, before the YAML and the flags
    are read; historic. ``options.add_section(name, dataclass_type)`` makes
    ``--NAME.FIELD value`` and a ``NAME:`` mapping in YAML valid; the parsed
    section is then ``config.section(NAME)``. Return nothing.

    Example::

        @dataclass
        class JudgeOptions:
            url: str = "http://127.0.0.1:8000/score"
            timeout: float = 10.0

        @hookimpl
        def rlhf_add_options(options):
            options.add_section("judge", JudgeOptions)
    """


@hookspec(historic=True)
def rlhf_configure(config: Config, plan: Plan) -> None:
    """See (and check) the final config before any process, model or GPU is taken.

    Called once after the config is parsed, every component resolved and every built-in
    combination checked; historic. ``plan`` holds the resolved components (``plan.placement``,
    ``plan.engine``, ``plan.learner``, ``plan.sync``, ``plan.estimator``, ``plan.policy_loss``,
    ``plan.kl``) with their capabilities, and which roles run. Check; do not modify: the config is
    final. Raise :class:`rlhf_plugins.ConfigError` with one line to reject a combination; the CLI
    prints it and exits with status 2. Return nothing.

    Example::

        @hookimpl
        def rlhf_configure(config, plan):
            if plan.learner.multi_rank is False and config.section("judge").shards > 1:
                raise ConfigError("judge.shards > 1 needs a learner that runs several ranks")
    """
