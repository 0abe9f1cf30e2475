"""Generation engines shipped with rlhf-plugins (transformers, vLLM), written against
:class:`rlhf_plugins.GenerationEngine`."""
