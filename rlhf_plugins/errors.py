"""Errors a user can fix. The CLI prints their one-line message and exits with 2."""
from __future__ import annotations


class UsageError(Exception):
    """A mistake in what the user asked for (config, plugin, data, reward)."""

    exit_code = 2


class ConfigError(UsageError):
    """An invalid config value or an impossible combination of components."""


class PluginError(UsageError):
    """A plugin that cannot be found, imported or registered."""


class RewardError(UsageError):
    """A reward function that raised or returned something unusable."""


class DataError(UsageError):
    """A prompt dataset that is missing, empty or lacks the configured keys."""
