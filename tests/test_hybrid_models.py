"""Models with recurrent layers (Mamba-2 here, as in Granite 4.0-H, Falcon-H1, Qwen3-Next's gated
delta-net): a layer's state runs along the sequence, so the learner's shared-prompt forward, token
packing and the transformers engine's shared prefill must not hand one sample's state to another."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import hybrid_model_path, random_batch


@pytest.fixture(scope="module")
def hybrid():
    from transformers import AutoModelForCausalLM

    path = hybrid_model_path()
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_recurrent_layers_are_told_apart_from_attention_ones(hybrid, tiny_model):
    from transformers import AutoModelForCausalLM

    from rlhf_plugins.models.recurrent import keeps_recurrent_state

    assert keeps_recurrent_state(hybrid[1])
    assert not keeps_recurrent_state(AutoModelForCausalLM.from_pretrained(tiny_model))

    class Engine(torch.nn.Module):  # as a DeepSpeed engine holds a model: its own config, the model as module
        def __init__(self, module: torch.nn.Module) -> None:
            super().__init__()
            self.config, self.module = {"train_batch_size": 8}, module

    assert keeps_recurrent_state(Engine(hybrid[1]))


def test_grouped_and_packed_log_probs_of_a_hybrid_model_are_each_samples_own(hybrid):
    """A batch of 3 prompts x 4 samples: its log-probs with the group marked (where attention-only
    models encode each prompt once) and in packed token-budget micro batches equal those of each
    sample run alone (before: transformers' recurrent cache took no repeated batch, and packing ran
    one sample's state into the next)."""
    from rlhf_plugins.models.forward import policy_forward
    from rlhf_plugins.models.packing import token_budget_split

    model = hybrid[1]
    batch = random_batch(group=4, prompts=3, seed=2)  # 4 to 12 tokens: short samples share rows when packed
    with torch.no_grad():
        alone = torch.cat([policy_forward(model, {k: v[i:i + 1] if torch.is_tensor(v) and v.dim() else v
                                                  for k, v in batch.items() if k != "group_size"})["logprobs"]
                           for i in range(batch["sequences"].shape[0])])
        grouped = policy_forward(model, batch)["logprobs"]
        (part,) = token_budget_split(batch, 1000)  # one micro batch of all twelve: one row, were it attention
        packed = torch.zeros_like(grouped)
        packed[part["rows"]] = policy_forward(model, part)["logprobs"]
    mask = batch["action_mask"].bool()
    assert batch["group_size"] == 4
    torch.testing.assert_close(grouped[mask], alone[mask], rtol=0, atol=1e-5)
    torch.testing.assert_close(packed[mask], alone[mask], rtol=0, atol=1e-5)


def test_the_transformers_engine_samples_a_hybrid_model_as_the_learner_scores_it(hybrid):
    """Four samples of each prompt from the transformers engine (each prefills its own prompt: a
    recurrent state is not shared) carry the log-probs the learner computes for them."""
    from rlhf_plugins import SamplingParams
    from rlhf_plugins.api import prepare
    from rlhf_plugins.engines.transformers_engine import TransformersEngine
    from rlhf_plugins.sync import verify_parity
    from rlhf_plugins.testing import backend_context
    from tests.helpers import Actor, batch_of, prompts

    path, model = hybrid
    config, pm, _ = prepare({"model": {"path": path}}, autoload=False)
    engine = TransformersEngine(backend_context(config, "generation", path, pm))
    ids = prompts(path)
    samples = engine.generate(ids, SamplingParams(n=4, max_new_tokens=5, seed=1))
    assert engine.recurrent and len(samples.completion_ids) == 16
    assert len({tuple(c) for c in samples.completion_ids}) > 4  # the samples of a prompt differ
    assert verify_parity(Actor(model), engine, batch_of(ids, samples, 4)) < 1e-4


def test_vllm_on_cpu_caches_no_prefixes_of_a_hybrid_model(hybrid, tiny_model):
    """vLLM caches a recurrent model's prefixes only with chunked prefill, which the CPU engine turns
    off (seeded sampling): a hybrid model's CPU engine starts without prefix caching (before: vLLM
    refused to start, "Chunked prefill is required for mamba cache mode 'align'"), other models keep it."""
    from rlhf_plugins.api import prepare
    from rlhf_plugins.engines.vllm_arguments import engine_arguments

    pytest.importorskip("vllm")
    config, _, _ = prepare({"generation": {"backend": "vllm"}}, autoload=False)
    hybrid_args = engine_arguments(config, hybrid[0], cpu=True, sleep=False)
    assert hybrid_args["enable_prefix_caching"] is False and hybrid_args["enable_chunked_prefill"] is False
    assert engine_arguments(config, tiny_model, cpu=True, sleep=False)["enable_prefix_caching"] is True


def test_a_config_vllm_refuses_is_one_line_with_its_reason_not_pydantics_link():
    """vLLM validates its config with pydantic, whose message ends in a link to pydantic's docs: the
    engine's one line carries the reason instead."""
    import pydantic

    from rlhf_plugins.engines.vllm_engine import _reason

    class Engine(pydantic.BaseModel):
        block: int

        @pydantic.model_validator(mode="after")
        def chunked(self) -> Engine:
            if self.block <= 0:  # vLLM's own validators assert
                raise AssertionError("Chunked prefill is required for mamba cache mode 'align'.")
            return self

    with pytest.raises(pydantic.ValidationError) as err:
        Engine(block=0)
    assert str(err.value).strip().splitlines()[-1].strip().startswith("For further information visit")
    assert _reason(err.value) == "Assertion failed, Chunked prefill is required for mamba cache mode 'align'."


def test_on_transformers_4_recurrent_layers_are_told_by_their_config_keys(monkeypatch):
    """transformers 4.x (the floor setup.cfg declares) has no recurrent cache layers to ask: the
    config's Mamba / gated delta-net keys tell, with the same answers as transformers 5's layers."""
    import transformers.cache_utils
    from transformers import FalconH1Config, GraniteMoeHybridConfig, LlamaConfig, MixtralConfig, Qwen3NextConfig

    from rlhf_plugins.models.recurrent import recurrent_config

    configs = [LlamaConfig(), MixtralConfig(), FalconH1Config(), Qwen3NextConfig(),
               GraniteMoeHybridConfig(num_hidden_layers=2, layer_types=["mamba", "attention"])]
    by_layers = [recurrent_config(c) for c in configs]
    monkeypatch.delattr(transformers.cache_utils, "LinearAttentionCacheLayerMixin")
    assert [recurrent_config(c) for c in configs] == by_layers == [False, False, True, True, True]
