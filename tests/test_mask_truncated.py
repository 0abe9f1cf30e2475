"""TRL's mask_truncated_completions / DAPO's overlong filtering (``--algo.policy_loss.mask_truncated``):
completions cut off by the budget leave the loss, after their rewards have counted in their group's
baseline."""
from __future__ import annotations

import json
import textwrap

import torch

from rlhf_plugins.training.rollout import Rollout, make_batch, mask_truncated
from tests.helpers import short_run


def test_the_rows_of_truncated_completions_are_masked_and_the_batch_as_generated_is_kept():
    rollout = Rollout(prompts=["a", "b", "c"], prompt_ids=[[1], [2, 3], [4]], completion_ids=[[5, 6], [7], [8, 9, 10]],
                      completions=["x", "y", "z"], finish_reasons=["length", "stop", "length"],
                      rollout_logprobs=[[-1.0, -1.0], [-1.0], [-1.0] * 3], columns={}, group_size=3,
                      scores=[0.0, 1.0, 0.5])
    batch = make_batch(rollout, pad_id=0)
    generated = batch["action_mask"].clone()
    shown = mask_truncated(batch, rollout)
    assert batch["action_mask"].sum(-1).tolist() == [0.0, 1.0, 0.0]
    assert torch.equal(shown["action_mask"], generated)  # lengths and tokens/s are of what was generated
    assert shown["action_mask"] is not batch["action_mask"]


def test_the_loss_sees_no_token_of_a_truncated_completion_and_group_advantages_of_every_sample(rlhf, tmp_path):
    seen = tmp_path / "seen.jsonl"
    plugin = tmp_path / "spy_loss.py"
    plugin.write_text(textwrap.dedent(f"""
        import json
        from rlhf_plugins import PolicyLoss, hookimpl
        from rlhf_plugins.algorithms.policy_losses import ppo

        def spy(x, o):
            rows = list(zip(x.action_mask.sum(-1).tolist(), x.advantages[:, 0].tolist()))
            open({str(seen)!r}, "a").write(json.dumps({{"loss": rows}}) + "\\n")
            return ppo(x, o)

        @hookimpl
        def rlhf_policy_losses():
            yield PolicyLoss("spy", compute=spy)

        @hookimpl
        def rlhf_after_rollout(step, rollout):
            open({str(seen)!r}, "a").write(json.dumps({{"rollout": [rollout.scores, rollout.finish_reasons,
                [len(c) for c in rollout.completion_ids], rollout.group_size]}}) + "\\n")
    """))
    code, _, err = rlhf("train", "--plugin", str(plugin), "--algo.policy_loss.name", "spy",
                        "--algo.policy_loss.mask_truncated", "true", "--generation.max_new_tokens", "2",
                        "--generation.temperature", "3",
                        *short_run("--train.steps", "1"))
    assert code == 0, err
    lines = [json.loads(line) for line in seen.read_text().splitlines()]
    (scores, reasons, lengths, group), = [r["rollout"] for r in lines if "rollout" in r]
    assert 0 < reasons.count("length") < len(reasons)  # both kinds in the batch
    grouped = torch.tensor(scores).view(-1, group)
    expected = ((grouped - grouped.mean(-1, keepdim=True)) / (grouped.std(-1, keepdim=True) + 1e-6)).flatten()
    want = sorted((float(n if why == "stop" else 0), round(a, 4)) for n, why, a in zip(lengths, reasons,
                                                                                       expected.tolist()))
    got = sorted((m, round(a, 4)) for r in lines if "loss" in r for m, a in r["loss"])
    assert got == want and any(a != 0 for m, a in got if m == 0)  # a truncated sample's advantage was not 0
