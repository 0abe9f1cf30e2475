"""``openrlhf.utils.agent`` as an OpenRLHF agent file imports it: the base classes, same names and
methods (defined in :mod:`rlhf_plugins.environments.openrlhf`)."""
from rlhf_plugins.environments.openrlhf import AgentExecutorBase, AgentInstanceBase

__all__ = ["AgentExecutorBase", "AgentInstanceBase"]
