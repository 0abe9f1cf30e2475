"""Reward models in the RL loop: load one as TRL's ``RewardTrainer`` or OpenRLHF saves it, render
prompt + completion with the model's own tokenizer and chat template, and score in batches.

Two formats, told apart by the folder:

* **sequence classification** (TRL ``RewardTrainer``, ``AutoModelForSequenceClassification`` with
  one label): ``config.architectures`` names a ``...ForSequenceClassification`` class;
* **OpenRLHF** (``get_llm_for_sequence_regression``): a causal-LM config, the backbone's weights
  and a one-output linear value head named by ``value_head_prefix`` (``score``, or the older
  ``value_head``); with ``normalize_reward`` in its config and ``--reward.normalize`` on the run (as
  OpenRLHF's ``--normalize_reward``) the score is ``(r - mean) / std`` with the ``mean`` / ``std``
  saved beside it.

Either way the score is read at the last non-padding token of ``prompt + completion`` (right
padding), which is EOS when the completion stopped, as both frameworks do. When the reward model
shares the policy's tokenizer and chat template, it scores the sampled tokens themselves; otherwise
the sample is rendered from text with its own template -- and a completion that ran out of budget
is rendered without the end of its turn, so a truncated answer is never scored as a finished one.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError

HEAD_PREFIXES = ("score", "value_head")



def applies_stored_stats(reward: Any) -> bool:
    """Whether a reward model's stored mean / std apply, to its scores and to a critic built from it
    (``--reward.normalize`` or ``--reward.model_normalize``; ``reward`` is the config's reward section)."""
    return bool(reward.normalize or reward.model_normalize)

@dataclass
class RewardModelInfo:
    path: Path
    kind: str  # "sequence-classification" | "openrlhf"
    head: str  # the head's weight name
    mean: float = 0.0
    std: float = 1.0


def _weight_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        except Exception as exc:  # noqa: BLE001 - a corrupt file: one line naming it
            raise ConfigError(f"reward model '{path}': cannot read '{file.name}' ({exc})") from exc
    return shapes


def inspect_reward_model(path: str | Path, head_prefix: str | None = None) -> RewardModelInfo:
    """What kind of reward model ``path`` holds, checked without loading it."""
    folder = Path(path).expanduser()
    info = find_reward_head(folder, head_prefix)
    if info is None:
        prefixes = (head_prefix,) if head_prefix else HEAD_PREFIXES
        raise ConfigError(f"'{path}' is not a reward model: no sequence-classification head and no value head named "
                          f"{' or '.join(prefixes)} (a causal LM alone cannot score; train one with `rlhf rm`)")
    if not any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise ConfigError(f"reward model '{path}' has no tokenizer; save the tokenizer beside it "
                          "(tokenizer.save_pretrained)")
    return info


def find_reward_head(folder: Path, head_prefix: str | None = None) -> RewardModelInfo | None:
    """The reward head of a model folder, ``None`` when it has none (a plain causal LM)."""
    path = folder
    config_file = folder / "config.json"
    if not config_file.is_file():
        from .folder import not_a_model_folder

        raise ConfigError(not_a_model_folder(f"reward model '{path}'", folder))
    try:
        config = json.loads(config_file.read_text())
    except ValueError as exc:
        raise ConfigError(f"reward model '{path}' has an unreadable config.json: {exc}") from exc
    architectures = config.get("architectures") or []
    shapes = _weight_shapes(folder)
    if any(a.endswith("ForSequenceClassification") for a in architectures):
        labels = int(config.get("num_labels", len(config.get("id2label", {}) or {}) or 1))
        if labels != 1:
            raise ConfigError(f"reward model '{path}' has a head with {labels} labels; a reward model scores "
                              "with one (num_labels=1)")
        head = next((n for n in shapes if n.split(".")[0] in HEAD_PREFIXES and n.endswith("weight")), "score.weight")
        return RewardModelInfo(folder, "sequence-classification", head)
    prefixes = (head_prefix,) if head_prefix else HEAD_PREFIXES
    for prefix in prefixes:
        shape = shapes.get(f"{prefix}.weight")
        if shape is not None:
            if shape[0] != 1:
                raise ConfigError(f"reward model '{path}' has a value head '{prefix}' with {shape[0]} outputs; "
                                  "a reward model scores with one")
            info = RewardModelInfo(folder, "openrlhf", f"{prefix}.weight")
            if config.get("normalize_reward"):
                info.mean, info.std = float(config.get("mean", 0.0)), float(config.get("std", 1.0))
            return info
    return None


def load_backbone(path: str, dtype: Any) -> Any:
    """The reward model's transformer without its head. transformers reports the head's weights as
    unexpected keys of the backbone (a table on stderr): loading the backbone alone is the intent, so
    that report is silenced (other warnings stay)."""
    import logging

    from transformers import AutoModel

    report = logging.getLogger("transformers.utils.loading_report")
    level = report.level
    report.setLevel(logging.ERROR)
    try:
        return AutoModel.from_pretrained(path, dtype=dtype, trust_remote_code=False)
    finally:
        report.setLevel(level)


class RewardHead:
    """Backbone + one-output linear head of a reward model (either format), returning hidden
    states and per-token scores; shared by the reward scorer and a critic started from it."""

    @staticmethod
    def load(info: RewardModelInfo, dtype: Any, normalize: bool = False) -> tuple[Any, Any]:
        """(backbone returning ``last_hidden_state``, head ``Linear(hidden, 1)``); ``normalize`` folds
        the model's stored mean / std in, as OpenRLHF does with ``--normalize_reward`` (only then)."""
        import torch
        from safetensors import safe_open

        backbone = load_backbone(str(info.path), dtype)
        weight = bias = None
        for file in sorted(info.path.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                names = set(f.keys())
                if info.head in names:
                    weight = f.get_tensor(info.head)
                    bias_name = info.head.rsplit(".", 1)[0] + ".bias"
                    bias = f.get_tensor(bias_name) if bias_name in names else None
        if weight is None:
            raise ConfigError(f"reward model '{info.path}' lost its head '{info.head}'")
        head = torch.nn.Linear(weight.shape[1], 1, dtype=dtype)
        mean, std = (info.mean, info.std) if normalize else (0.0, 1.0)
        with torch.no_grad():
            head.weight.copy_(weight / std)
            head.bias.copy_(((bias if bias is not None else torch.zeros(1)) - mean) / std)
        return backbone, head


class RewardModelScorer:
    """Scores (prompt, completion) texts with one reward model, ``batch_size`` at a time."""

    def __init__(self, path: str, dtype: str = "float32", batch_size: int = 16, head_prefix: str | None = None,
                 device: str | None = None, policy_tokenizer: Any = None, normalize: bool = False,
                 template_kwargs: dict[str, Any] | None = None) -> None:
        import torch
        from transformers import AutoTokenizer

        from .forward import DTYPES

        self.info = inspect_reward_model(path, head_prefix)
        self.name = self.info.path.name
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.backbone, self.head = RewardHead.load(self.info, DTYPES[dtype], normalize)
        self.backbone.to(self.device).eval().requires_grad_(False)
        self.head.to(self.device).eval().requires_grad_(False)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.info.path), trust_remote_code=False)
        self.template_kwargs = dict(template_kwargs or {})
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.batch_size = batch_size
        #: the policy's token ids mean the same to this model: score them as sampled
        self.same_tokens = policy_tokenizer is not None and _same_tokenizer(self.tokenizer, policy_tokenizer)

    def render(self, prompt: Any, completion: str, finished: bool = True) -> list[int]:
        """The reward model's tokens for one sample: its own chat template when it has one
        (prompt as the user turn, the completion as the assistant turn, closed only when the
        completion ``finished``), else the plain text (EOS appended when finished)."""
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            if finished:
                turn = {"role": "assistant", "content": completion}
                text = tok.apply_chat_template([*messages, turn], tokenize=False, **self.template_kwargs)
            else:
                text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                               **self.template_kwargs) + completion
            return tok(text, add_special_tokens=False)["input_ids"]
        text = (prompt if isinstance(prompt, str) else " ".join(m.get("content", "") for m in prompt)) + completion
        ids = tok(text)["input_ids"]
        if finished and tok.eos_token_id is not None and ids[-1:] != [tok.eos_token_id]:
            ids.append(tok.eos_token_id)
        return ids

    def __call__(self, prompts: list[Any], completions: list[str], prompt_ids: list[list[int]] | None = None,
                 completion_ids: list[list[int]] | None = None, finish_reasons: list[str] | None = None) -> list[float]:
        import torch

        if self.same_tokens and prompt_ids is not None and completion_ids is not None:
            encoded = [p + c for p, c in zip(prompt_ids, completion_ids)]
        else:
            finished = [r == "stop" for r in finish_reasons] if finish_reasons else [True] * len(completions)
            encoded = [self.render(p, c, f) for p, c, f in zip(prompts, completions, finished)]
        out: list[float] = []
        with torch.inference_mode():
            for start in range(0, len(encoded), self.batch_size):
                out += self.score_ids(encoded[start : start + self.batch_size])
        return out

    def score_ids(self, rows: list[list[int]]) -> list[float]:
        """Scores of tokenized samples (one forward, right padding, read at each last token)."""
        import torch

        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r)
            mask[i, : len(r)] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        hidden = self.backbone(input_ids=ids, attention_mask=mask,
                               position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).last_hidden_state
        last = (mask.sum(-1) - 1).clamp(min=0)
        values = self.head(hidden[torch.arange(len(rows), device=ids.device), last]).squeeze(-1)
        return values.float().cpu().tolist()


def _same_tokenizer(a: Any, b: Any) -> bool:
    return a.get_vocab() == b.get_vocab() and getattr(a, "chat_template", None) == getattr(b, "chat_template", None)
