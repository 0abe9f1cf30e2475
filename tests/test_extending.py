"""Wrapping a builtin backend (rlhf_plugins.extending, examples/extending_builtins.py): the wrapper's
override runs, and every capability and optional method of the builtin survives."""
from __future__ import annotations

import json
import pickle

import pytest

from rlhf_plugins import GenerationBackend, LearnerBackend, WeightSyncMethod
from rlhf_plugins.errors import ConfigError
from rlhf_plugins.extending import Delegate, builtin, derive
from rlhf_plugins.protocols import OPTIONAL
from tests.helpers import EXAMPLES, metrics_of, short_run, the_run


def test_a_derived_registration_keeps_every_capability_of_the_builtin():
    base = builtin(GenerationBackend, "vllm")
    mine = derive(base, "vllm_logged", Delegate)
    assert (mine.name, mine.supports_adapter, mine.supports_shared_weights) == ("vllm_logged", True, False)
    assert (mine.memory, mine.max_length, mine.workers, mine.requires) == (base.memory, base.max_length, base.workers,
                                                                          base.requires)
    sync = derive(builtin(WeightSyncMethod, "inprocess"), "mine", Delegate)
    assert sync.same_process is True and sync.shares_weights is not None
    assert derive(builtin(LearnerBackend, "deepspeed"), "ds", Delegate).multi_rank is True
    assert pickle.loads(pickle.dumps(mine.factory)).wrap is Delegate  # reaches Ray workers


def test_builtin_names_what_it_lacks():
    with pytest.raises(ConfigError, match="no builtin generation backend named 'vlm'"):
        builtin(GenerationBackend, "vlm")


def test_a_delegate_keeps_optional_methods_a_plain_wrapper_drops():
    class Engine:
        def generate(self, prompt_ids, params):
            return "inner"

        def logprobs(self, batch):
            return "logprobs"

        def share_weights(self, named):
            return True

    class Plain:
        def __init__(self, inner):
            self.inner = inner

        def generate(self, prompt_ids, params):
            return "wrapped"

    class Wrapped(Delegate):
        def generate(self, prompt_ids, params):
            return "wrapped"

    lost = [name for name in OPTIONAL["engine"] if hasattr(Engine, name) and not hasattr(Plain(Engine()), name)]
    assert lost == ["logprobs", "share_weights"]
    w = Wrapped(Engine())
    assert (w.generate([], None), w.logprobs(None), w.share_weights([])) == ("wrapped", "logprobs", True)
    assert not hasattr(w, "load_adapter")  # what the builtin lacks, the wrapper lacks too
    assert pickle.loads(pickle.dumps(Delegate([1, 1, 2]))).count(1) == 2  # unpickles without recursing


def test_training_with_wrapped_engine_learner_and_sync(rlhf):
    code, _, err = rlhf("train", "--plugin", str(EXAMPLES / "extending_builtins.py"),
                        "--generation.backend", "transformers_counted", "--learner.backend", "torch_metered",
                        "--sync.method", "inprocess_counted", "--sync.verify", "true",
                        *short_run("--train.steps", "2"))
    assert code == 0, err  # --sync.verify reached the wrapped engine's logprobs()
    run = the_run()
    counts = json.loads((run / "extending_counts.json").read_text())
    # every sync moved nothing: the wrapped sync's attach() and the wrapped learner's live_weights()
    # and engine's share_weights() were all found through the wrappers
    assert counts["syncs"] == counts["shared_syncs"] == 2 and counts["train_calls"] == 2
    assert counts["generate_calls"] >= 2 and counts["sampled_tokens"] > 0
    assert all(row["extending/update_seconds"] > 0 for row in metrics_of(run))
