"""Builtin model loading: ``transformers`` ``AutoModelForCausalLM`` from a local folder
(the critic: the same backbone with a value head). The architecture is built with empty parameters
and read from the checkpoint one tensor at a time, or left empty for a sharded learner (each rank
reads its shards) and an engine fed by sync (:mod:`rlhf_plugins.models.empty_init`);
``from_pretrained`` where the checkpoint's names need converting.

``trylast``, so any plugin may answer first or wrap it."""
from __future__ import annotations

from typing import Any

from .._markers import hookimpl
from ..errors import ConfigError


@hookimpl(trylast=True)
def rlhf_load_model(role: str, path: str, config: Any) -> Any:
    from transformers import AutoModelForCausalLM

    from ..models import empty_init
    from ..models.forward import DTYPES

    try:
        if role == "critic":
            from ..models.reward_model import applies_stored_stats
            from ..models.value_model import ValueModel

            return ValueModel.from_pretrained(path, dtype=DTYPES[config.model.dtype],
                                              normalize=applies_stored_stats(config.reward),
                                              empty=empty_init.wanted())
        # built empty, then filled tensor by tensor -- or left empty for a sharded learner, which reads
        # each rank's shard itself, and an engine whose weights come by sync
        model = empty_init.build_empty(path, DTYPES[config.model.dtype], config.model.trust_remote_code)
        if model is not None:
            return model if empty_init.wanted() else empty_init.fill(model)
        return AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[config.model.dtype],
                                                    trust_remote_code=config.model.trust_remote_code)
    except OSError as exc:
        raise ConfigError(f"cannot load the {role} model from '{path}': {str(exc).splitlines()[0]}") from exc
