"""Tool calls: read them from a model turn with the model's own chat template, run them (sync or
async), and turn their results into the tokens the template puts after the turn.

Parsing uses ``tokenizer.parse_response`` when the tokenizer carries a ``response_template``
(transformers' response parsing, the same TRL relies on); a tokenizer without one is read in the
common ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` format. A call the parser cannot
read, a tool that is not offered and a tool that raises all become an observation the model sees
(``{"error": "..."}``, as TRL does) and are counted.
"""
from __future__ import annotations

import asyncio
import functools
import inspect
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


@dataclass
class ToolCall:
    """One call the model made: ``name`` and ``arguments``, or ``error`` when it could not be read."""

    name: str
    arguments: dict[str, Any]
    error: str | None = None


def parse_tool_calls(tokenizer: Any, text: str, prefix: str = "") -> list[ToolCall]:
    """The tool calls of one model turn (its decoded text, special tokens kept)."""
    return parse_turn(tokenizer, text, prefix)[1]


def parse_turn(tokenizer: Any, text: str, prefix: str = "") -> tuple[str, list[ToolCall]]:
    """``(content, tool calls)`` of one model turn (its decoded text, special tokens kept): the
    message text without the call markup and end token, and the calls."""
    plain = _HERMES.sub("", text)
    for special in (tokenizer.eos_token, tokenizer.pad_token):
        if special:
            plain = plain.replace(special, "")
    if getattr(tokenizer, "response_template", None) is not None or getattr(tokenizer, "response_schema", None):
        if "tool_call" not in text and "function" not in text:
            return plain.strip(), []  # nothing that looks like a call: skip the parser
        try:
            message = tokenizer.parse_response(text, prefix=prefix)
        except Exception as exc:  # the template's parser rejects a malformed call
            return plain.strip(), [ToolCall("?", {}, f"the tool call could not be parsed: {_first_line(exc)}")]
        content = message.get("content")
        return (content.strip() if isinstance(content, str) else plain.strip(),
                [_from_message(call) for call in message.get("tool_calls") or []])
    return plain.strip(), _hermes_calls(text)


def _hermes_calls(text: str) -> list[ToolCall]:
    calls = []
    for body in _HERMES.findall(text):
        try:
            data = json.loads(body)
        except json.JSONDecodeError as exc:
            calls.append(ToolCall("?", {}, f"the tool call is not JSON: {exc}"))
            continue
        calls.append(_from_message({"function": data} if isinstance(data, dict) else data))
    return calls


def _from_message(call: Any) -> ToolCall:
    fn = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        return ToolCall("?", {}, f"a tool call needs a name: {str(call)[:80]}")
    args = fn.get("arguments") or {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return ToolCall(fn["name"], {}, f"the arguments of '{fn['name']}' are not JSON: {args[:80]}")
    if not isinstance(args, dict):
        return ToolCall(fn["name"], {}, f"the arguments of '{fn['name']}' must be an object, not {type(args).__name__}")
    return ToolCall(fn["name"], args)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


async def call_tool(tools: dict[str, Callable[..., Any]], call: ToolCall,
                    run_sync: Callable[..., Any]) -> tuple[Any, bool]:
    """``(result, failed)``: the tool's result, or ``{"error": ...}`` and True. ``run_sync(fn,
    **kwargs)`` runs a synchronous tool off the event loop."""
    if call.error is not None:
        return {"error": call.error}, True
    fn = tools.get(call.name)
    if fn is None:
        offered = ", ".join(sorted(tools)) or "none"
        return {"error": f"Tool {call.name} not found (tools: {offered})."}, True
    try:
        if inspect.iscoroutinefunction(fn):
            return await fn(**call.arguments), False
        return await run_sync(fn, **call.arguments), False
    except Exception as exc:  # the error goes back to the model as its observation
        return {"error": _first_line(exc)}, True


class Renderer:
    """The token ids the chat template puts after a model turn for some follow-up messages (tool
    results), rendered once against a fixed dummy conversation: the model's own tokens are never
    decoded and re-encoded."""

    _BASE = [{"role": "user", "content": "x"},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"type": "function", "function": {"name": "dummy", "arguments": {}}}]}]

    def __init__(self, tokenizer: Any, template_kwargs: dict[str, Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        self._base = tokenizer.apply_chat_template(self._BASE, tokenize=False, **self.template_kwargs)
        self._cache: dict[str, list[int]] = {}

    def suffix_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        key = json.dumps(messages, sort_keys=True, default=str)
        hit = self._cache.get(key)
        if hit is not None:
            return list(hit)
        full = self.tokenizer.apply_chat_template(self._BASE + messages, tokenize=False, add_generation_prompt=True,
                                                  **self.template_kwargs)
        if not full.startswith(self._base):
            raise ValueError("the chat template renders earlier messages differently once a tool message follows; "
                             "multi-turn training needs a prefix-preserving template")
        ids = self.tokenizer(full[len(self._base):], add_special_tokens=False)["input_ids"]
        if len(self._cache) < 65536:  # tool replies repeat (the same result of the same call): render once
            self._cache[key] = list(ids)
        return ids

    def prompt_ids(self, text: str) -> list[int]:
        """A rendered prompt's token ids (prompts repeat: every sample of a row starts alike)."""
        hit = self._cache.get(text)
        if hit is None:
            hit = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(self._cache) < 65536:
                self._cache[text] = hit
        return list(hit)


def tool_message(name: str, result: Any) -> dict[str, Any]:
    return {"role": "tool", "name": name, "content": result if isinstance(result, str) else _dump(result)}


def _dump(result: Any) -> str:
    try:
        return json.dumps(result) if isinstance(result, (dict, list)) else str(result)
    except (TypeError, ValueError):
        return str(result)


def public_methods(instance: Any) -> list[Callable[..., Any]]:
    """The tools of a TRL-style environment: its public methods other than reset and get_reward
    (listed on the class, so properties are not evaluated)."""
    return [getattr(instance, name) for name in _tool_names(type(instance))]


@functools.lru_cache(maxsize=256)
def _tool_names(cls: type) -> tuple[str, ...]:
    return tuple(name for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
                 if name not in ("reset", "get_reward") and not name.startswith("_"))


def run_in(pool: Any) -> Callable[..., Any]:
    """``run_sync`` for :func:`call_tool`: a synchronous function on ``pool`` (a thread pool)."""

    async def run(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(pool, lambda: fn(*args, **kwargs))

    return run
