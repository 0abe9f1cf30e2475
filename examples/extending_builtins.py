"""Extending builtin backends: one plugin file wraps the transformers engine, the torch learner
and the in-process weight sync, changing one thing about each and keeping everything else they
can do (adapter sync, shared weights, ``--sync.verify``'s log-probs, the memory plan's models):

    rlhf train --plugin examples/extending_builtins.py --generation.backend transformers_counted \
        --learner.backend torch_metered --sync.method inprocess_counted

* ``transformers_counted`` counts generate calls and sampled tokens;
* ``torch_metered`` adds ``extending/update_seconds`` to every step's metrics;
* ``inprocess_counted`` counts syncs and whether each moved nothing (the engine shares the
  learner's parameters, set up by the wrapped sync's own optional ``attach``).

At the end the counts are written to ``extending_counts.json`` in the run directory.
"""
from __future__ import annotations

import json
import time
from collections import Counter

from rlhf_plugins import GenerationBackend, LearnerBackend, WeightSyncMethod, hookimpl
from rlhf_plugins.extending import Delegate, builtin, derive

#: what the wrappers saw in this process (the local placement runs every role here)
COUNTS: Counter = Counter()


class CountedEngine(Delegate):
    def generate(self, prompt_ids, params):
        samples = self.inner.generate(prompt_ids, params)
        COUNTS["generate_calls"] += 1
        COUNTS["sampled_tokens"] += sum(len(c) for c in samples.completion_ids)
        return samples


class MeteredLearner(Delegate):
    def train(self, batch, objective):
        start = time.perf_counter()
        metrics = self.inner.train(batch, objective)
        COUNTS["train_calls"] += 1
        return {**metrics, "extending/update_seconds": time.perf_counter() - start}


class CountedSync(Delegate):
    def sync(self, actor, engine, step):
        info = self.inner.sync(actor, engine, step)
        COUNTS["syncs"] += 1
        COUNTS["shared_syncs"] += bool(info.get("shared"))
        return info


@hookimpl
def rlhf_generation_backends():
    yield derive(builtin(GenerationBackend, "transformers"), "transformers_counted", CountedEngine)


@hookimpl
def rlhf_learner_backends():
    yield derive(builtin(LearnerBackend, "torch"), "torch_metered", MeteredLearner)


@hookimpl
def rlhf_weight_sync_methods():
    yield derive(builtin(WeightSyncMethod, "inprocess"), "inprocess_counted", CountedSync)


@hookimpl
def rlhf_after_train(run_dir, metrics):
    (run_dir / "extending_counts.json").write_text(json.dumps(dict(COUNTS)))
