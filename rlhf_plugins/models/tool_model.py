"""The embedded tool-calling model and task: a tiny Llama that can call a calculator.

``rlhf train --env.name calculator`` uses it: two-digit sums the tiny model cannot do in its head,
and a ``calculator`` tool that can. Its short pre-training answers most sums directly (and wrongly)
and calls the tool on about one sum in five, copying the sum into the call and the tool's result
into the answer, so reinforcement learning has one thing to discover: calling the tool pays.

Its chat template renders tool calls (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``)
and tool messages (``<|tool|>...``), and the tokenizer carries a ``response_template``, so
``tokenizer.parse_response`` (and TRL's ``GRPOTrainer``) parse its tool calls unchanged.
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any

RECIPE_VERSION = 2
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>",
                  "<tool_call>", "</tool_call>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|system|>tools:{% for tool in tools %} "
    "{{ tool.function.name if tool.function is defined else tool.name }}{% endfor %}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}<|system|>{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}<|user|>{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}<|assistant|>{{ message['content'] or '' }}"
    "{% for call in message.get('tool_calls') or [] %}"
    "{% set fn = call.function if call.function is defined else call %}"
    "<tool_call>{\"name\": \"{{ fn.name }}\", \"arguments\": "
    "{{ fn.arguments | tojson if fn.arguments is mapping else fn.arguments }}}</tool_call>"
    "{% endfor %}{{ eos_token }}"
    "{% elif message['role'] == 'tool' %}<|tool|>{{ message['content'] }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
#: how ``tokenizer.parse_response`` reads an assistant turn of this template (transformers >= 5.13)
RESPONSE_TEMPLATE: dict[str, Any] = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|assistant|>",
    "fields": {
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<\|eos\|>\s*", "content": "text"},
    },
}
SPLITS = ("all", "train", "test")


def calculator(expression: str) -> str:
    """Evaluate a sum or difference of whole numbers.

    Args:
        expression: numbers joined by + or -, e.g. "47+38"
    """
    import re

    text = expression.replace(" ", "")
    if not re.fullmatch(r"-?\d+([+-]\d+)*", text):
        raise ValueError(f"cannot evaluate {expression!r}: use whole numbers joined by + or -")
    return str(sum(int(term) for term in re.findall(r"[+-]?\d+", text)))


def calculator_rows(split: str = "all") -> list[dict[str, str]]:
    """Sums of two numbers from 50 to 99 (three-digit results): ``all`` 300, ``train`` 240 of them,
    ``test`` the other 60 (every fifth)."""
    rng = random.Random(1234)
    rows = []
    for _ in range(300):
        a, b = rng.randrange(50, 100), rng.randrange(50, 100)
        rows.append({"prompt": f"{a}+{b}=", "label": str(a + b)})
    if split == "all":
        return rows
    return [r for i, r in enumerate(rows) if (i % 5 == 0) == (split == "test")]


def tool_model_path(*, quiet: bool = False) -> str:
    """Path of the tool-calling tiny Llama (shipped with the package; see :mod:`.tiny_model`)."""
    from .tiny_model import shipped_model

    return shipped_model(f"tiny-llama-tools-v{RECIPE_VERSION}", build_tool_llama, quiet=quiet)


def tool_schema() -> dict[str, Any]:
    from transformers.utils import get_json_schema

    return get_json_schema(calculator)


def build_tool_llama(out: Path, *, seed: int = 0, steps: tuple[int, int] = (450, 150),
                     tool_prob: tuple[float, float] = (0.5, 0.2), batch_size: int = 32) -> None:
    """Train the tokenizer, pre-train on sums answered directly (a random number) or through one
    calculator call -- first often (to learn copying into the call), then on one sum in five (so
    calling is what RL has to learn) -- and ``save_pretrained`` both. (Recipe 1 ended on one in
    ten; the model it gave called the tool on 5% of sums on some CPUs and RL never found it.)"""
    import torch

    from .tiny_model import build_tokenizer, pretrain

    rng = random.Random(seed)
    torch.manual_seed(seed)
    rows = calculator_rows()
    tools = [tool_schema()]

    def conversation(row: dict[str, str], use_tool: bool, answer: str) -> list[dict[str, Any]]:
        user = {"role": "user", "content": row["prompt"]}
        if not use_tool:
            return [user, {"role": "assistant", "content": answer}]
        call = {"type": "function", "function": {"name": "calculator",
                                                 "arguments": {"expression": row["prompt"].rstrip("=")}}}
        return [user, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": "calculator", "content": row["label"]},
                {"role": "assistant", "content": row["label"]}]

    def render(tokenizer: Any, messages: list[dict[str, Any]]) -> str:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)

    # the tokenizer learns from both kinds of turn, with every answer the task can have
    probe = build_tokenizer(["x"], SPECIAL_TOKENS, CHAT_TEMPLATE, vocab_size=len(SPECIAL_TOKENS) + 256)
    corpus = [render(probe, conversation(r, use, r["label"])) for r in rows for use in (False, True)]
    corpus += [str(n) for n in range(100, 199)] * 4
    tokenizer = build_tokenizer(corpus, SPECIAL_TOKENS, CHAT_TEMPLATE, vocab_size=512, single_digits=True)
    tokenizer.response_template = RESPONSE_TEMPLATE

    done = [0]

    def batch() -> list[str]:  # fresh sums (not the task's rows): copying is learnt for any sum
        p = tool_prob[0] if done[0] < steps[0] else tool_prob[1]
        done[0] += 1
        picked = []
        for _ in range(batch_size):
            a, b = rng.randrange(50, 100), rng.randrange(50, 100)
            picked.append({"prompt": f"{a}+{b}=", "label": str(a + b)})
        return [render(tokenizer, conversation(r, rng.random() < p, str(rng.randrange(100, 199)))) for r in picked]

    pretrain(out, tokenizer, batch, sum(steps))


if __name__ == "__main__":  # pragma: no cover - regenerating the shipped model
    import sys

    build_tool_llama(Path(sys.argv[1]))
