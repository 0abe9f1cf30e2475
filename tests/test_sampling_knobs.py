"""min-p sampling, the repetition penalty and stop strings (TRL's min_p / repetition_penalty /
generation_kwargs stop, vLLM's sampling parameters) in the transformers engine: what is drawn and the
log-probs it reports, by hand."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from rlhf_plugins import SamplingParams
from rlhf_plugins.engines.transformers_engine import filter_logits, sample_token
from tests.helpers import draws_of_a_seeded_engine, sampling_logprobs, stopped_by_strings


def test_min_p_leaves_out_exactly_the_tokens_below_its_share_of_the_top_probability():
    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3
    probs = torch.softmax(logits, -1)
    kept = torch.isfinite(filter_logits(logits, 0, 1.0, min_p=0.2))
    assert torch.equal(kept, probs >= 0.2 * probs.max(-1, keepdim=True).values)
    assert kept.sum(-1).min() >= 1 and (~kept).any()


def test_the_repetition_penalty_and_temperature_give_the_logprob_returned_for_the_drawn_token():
    torch.manual_seed(1)
    logits = torch.randn(4, 30) * 2
    seen = torch.rand(4, 30) < 0.3
    params = SamplingParams(temperature=0.7, repetition_penalty=1.8, min_p=0.05)
    token, logp = sample_token(logits, params, torch.rand(4), seen)
    by_hand = torch.where(seen, torch.where(logits > 0, logits / 1.8, logits * 1.8), logits) / 0.7
    assert torch.allclose(logp, torch.log_softmax(by_hand, -1).gather(-1, token[:, None]).squeeze(-1))
    probs = torch.softmax(by_hand, -1)
    assert (probs.gather(-1, token[:, None]).squeeze(-1) >= 0.05 * probs.max(-1).values).all()


@pytest.fixture(scope="module")
def engine_and_model(tiny_model):
    from transformers import AutoModelForCausalLM

    from rlhf_plugins.api import prepare
    from rlhf_plugins.engines.transformers_engine import TransformersEngine
    from rlhf_plugins.testing import backend_context

    config, pm, _ = prepare({}, autoload=False)
    return TransformersEngine(backend_context(config, "generation", tiny_model, pm)), \
        AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)


def test_equal_prompts_and_adjacent_seeds_are_independent_draws(engine_and_model):
    """One generator of the call's seed for the whole batch: equal prompts of a call, and calls whose
    seeds differ by one, draw different samples; the same seed the same ones."""
    draws = draws_of_a_seeded_engine(engine_and_model[0])
    assert len(set(draws["repeated"])) == 6
    assert draws["seed6"][:2] != draws["seed5"][1:] and not set(draws["seed5"]) & set(draws["seed6"])
    assert draws["again"] == draws["repeated"]


def uneven_prompts(model_path: str) -> list[list[int]]:
    """Prompts of different lengths (left padding in a batch)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    return [tok(text)["input_ids"] for text in ("3+3=", "12+7=", "9+9=9+9=", "1")]


@pytest.mark.parametrize("n, pad", [(1, "pad"), (3, "pad"), (3, "eos")])
def test_the_engines_samples_carry_the_penalized_tempered_logprobs_by_hand(engine_and_model, tiny_model, monkeypatch,
                                                                           n, pad):
    """``pad eos``: padding with the EOS token (a model without a pad token) does not make EOS a
    repeated token of the shorter prompts."""
    engine, model = engine_and_model
    if pad == "eos":
        monkeypatch.setattr(engine, "pad_id", int(engine.eos_ids[0]))
    ids = uneven_prompts(tiny_model)
    params = SamplingParams(n=n, max_new_tokens=8, temperature=0.8, repetition_penalty=1.5, min_p=0.02, seed=3)
    samples = engine.generate(ids, params)
    plain = engine.generate(ids, SamplingParams(n=n, max_new_tokens=8, temperature=0.8, seed=3))
    assert samples.completion_ids != plain.completion_ids  # the penalty changed what was drawn
    for i, completion, logprobs in zip(samples.prompt_index, samples.completion_ids, samples.logprobs):
        want, probs = sampling_logprobs(model, ids[i], completion, 0.8, 1.5)
        assert torch.allclose(torch.tensor(logprobs, dtype=torch.float64), want, atol=1e-4)
        drawn = probs.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)
        assert (drawn >= 0.02 * probs.max(-1).values).all()  # min-p: nothing below its share was drawn


def test_a_stop_string_ends_a_completion_at_the_token_that_completes_it(engine_and_model, tiny_model):
    """The same draws as without stop strings, cut after the token whose text completes one (kept, as vLLM
    keeps it), finish reason "stop"; a completion without one is unchanged. At temperature 4 the tiny
    model writes long, varied text."""
    from transformers import AutoTokenizer

    engine, _ = engine_and_model
    tok = AutoTokenizer.from_pretrained(tiny_model)
    ids = uneven_prompts(tiny_model)
    free = SamplingParams(n=4, max_new_tokens=12, temperature=4.0, seed=3)
    plain = engine.generate(ids, free)
    stop = ("1", "s")
    cut = engine.generate(ids, dataclasses.replace(free, stop=stop))
    assert stopped_by_strings(tok, cut, stop) >= 4
    for full, was, short, reason in zip(plain.completion_ids, plain.finish_reasons, cut.completion_ids,
                                        cut.finish_reasons):
        assert full[: len(short)] == short  # the same draws, up to where the stop string ended it
        texts = [tok.decode(full[:k], skip_special_tokens=True) for k in range(1, len(full) + 1)]
        first = next((k for k, text in enumerate(texts, 1) if any(x in text for x in stop)), None)
        assert len(short) == (first if first is not None else len(full))
        assert reason == ("stop" if first is not None else was)
