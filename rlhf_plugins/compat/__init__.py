"""Real modules that stand in for other projects' modules where a user's file imports them and the
project is not installed (see :func:`rlhf_plugins.environments.openrlhf.agent_imports`)."""
