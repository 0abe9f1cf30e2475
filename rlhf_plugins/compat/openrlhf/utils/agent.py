"""``openrlhf.utils.agent`` as an OpenRLHF agent file imports it: the base classes and the multi-turn
executor, same names and methods (defined in :mod:`rlhf_plugins.environments.openrlhf`)."""
from rlhf_plugins.environments.openrlhf import AgentExecutorBase, AgentInstanceBase, MultiTurnAgentExecutor

__all__ = ["AgentExecutorBase", "AgentInstanceBase", "MultiTurnAgentExecutor"]
