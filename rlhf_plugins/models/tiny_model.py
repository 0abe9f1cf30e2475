"""The embedded default model: a tiny Llama with a locally trained tokenizer.

``rlhf train`` with no model path uses it, and so do the tests: nothing is
downloaded from a model hub. It ships with the package (``rlhf_plugins/assets/models``,
1.7 MB of safetensors, checked against :data:`DIGESTS`), so every machine trains the very same
model: built on each machine, its float32 pre-training took a different path on every CPU type
(their matmul kernels round differently) and the tests tuned on one failed on another.
:func:`build_tiny_llama` is the recipe that made it (``python -m rlhf_plugins.models.tiny_model
OUT`` rebuilds it). Its shape suits vLLM's CPU attention (head_dim 32).

It is a *base* model for the built-in addition task: a short pre-training on
sums that are right only about a third of the time teaches it the format
(``<|user|>3+4=<|assistant|>7<eos>``) but not the arithmetic, so RL has
something real to learn.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .folder import save_pretrained, save_tokenizer

RECIPE_VERSION = 1
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}<|system|>{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}<|user|>{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}<|assistant|>{{ message['content'] }}{{ eos_token }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>"]
TASK_FILE = Path(__file__).resolve().parent.parent / "assets" / "addition.jsonl"


def cache_dir() -> Path:
    return Path(os.environ.get("RLHF_CACHE_DIR") or Path.home() / ".cache" / "rlhf-plugins")


#: sha256 of the shipped models' weights (tests check them: the models everyone trains are these)
DIGESTS = {
    "tiny-llama-v1": "9b92658690338398427ea7a952f7381d6f1d19d6c7fcc3f95ae61a623ccea4aa",
    "tiny-llama-tools-v2": "569e9d46bcef9e92b4ef2242f2bafd9ba5028f05301fcaf3f962974900431ed8",
}
SHIPPED = Path(__file__).resolve().parent.parent / "assets" / "models"


def shipped_model(name: str, build: Callable[[Path], None], *, quiet: bool = False) -> str:
    """The model shipped as ``assets/models/<name>``, or (a source tree without it) built once into
    the cache by ``build``."""
    folder = SHIPPED / name
    if (folder / "config.json").is_file():
        return str(folder)
    return cached_build(name, build, quiet=quiet)


def default_model_path(*, quiet: bool = False) -> str:
    """Path of the embedded tiny Llama."""
    return shipped_model(f"tiny-llama-v{RECIPE_VERSION}", build_tiny_llama, quiet=quiet)


def cached_build(name: str, build: Callable[[Path], None], *, quiet: bool = False) -> str:
    """``cache_dir() / name``, built by ``build(folder)`` once (atomically, one process at a time)."""
    target = cache_dir() / name
    if (target / "config.json").is_file():
        check_cached(target)
        return str(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        from ..errors import ConfigError

        raise ConfigError(f"cannot create the cache folder '{target.parent}' ({exc.strerror or exc}); set "
                          "RLHF_CACHE_DIR to a writable folder") from exc
    with _lock(target.parent / f".{target.name}.lock"):
        if not (target / "config.json").is_file():
            if not quiet:
                print(f"building the embedded {name} once into {target} ...", flush=True)
            tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
            try:
                build(tmp)
                os.replace(tmp, target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def check_cached(target: Path) -> None:
    """A damaged cached model says how to rebuild it."""
    from ..errors import ConfigError
    from .folder import check_model_folder

    try:
        check_model_folder(target, f"the cached model '{target.name}' at")
    except ConfigError as exc:
        raise ConfigError(f"{exc} -- delete '{target}' and run again to rebuild it") from None


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


#: the built-in addition task and its fixed split (every fifth sum is held out)
SPLITS = ("all", "train", "test")


def task_rows(split: str = "all") -> list[dict[str, str]]:
    """Rows of the built-in addition task: ``all`` 100 sums, ``train`` 80 of them, ``test`` the
    other 20 (held out by the stages, the pipeline and evaluation)."""
    rows = [json.loads(line) for line in TASK_FILE.read_text().splitlines() if line.strip()]
    if split == "all":
        return rows
    return [r for i, r in enumerate(rows) if (i % 5 == 0) == (split == "test")]


def build_tokenizer(corpus: list[str], special_tokens: list[str] = SPECIAL_TOKENS, chat_template: str = CHAT_TEMPLATE,
                    vocab_size: int = 384, single_digits: bool = False):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if single_digits:  # every digit its own token: numbers are copied digit by digit
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), tok.pre_tokenizer])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|pad|>",
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        padding_side="left",
        chat_template=chat_template,
        model_max_length=256,
    )


def build_tiny_llama(out: Path, *, seed: int = 0, steps: int = 600, correct_prob: float = 0.5) -> None:
    """Train the tokenizer, pre-train the base model on noisy sums, ``save_pretrained`` both."""
    import torch

    rng = random.Random(seed)
    torch.manual_seed(seed)
    rows = task_rows()
    english = (
        "Reinforcement learning from human feedback trains a policy with rewards. "
        "The answer is a number. Write the sum of the two numbers. Question: what is it? "
    )
    corpus = [f"{r['prompt']}{a}" for r in rows for a in range(19)] + [english] * 20
    tokenizer = build_tokenizer(corpus)

    def noisy(row: dict[str, str]) -> str:
        answer = row["label"] if rng.random() < correct_prob else str(rng.randrange(19))
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": answer}],
            tokenize=False,
        )

    pretrain(out, tokenizer, lambda: [noisy(r) for r in rows], steps)


def pretrain(out: Path, tokenizer: Any, batch_texts: Callable[[], list[str]], steps: int, lr: float = 3e-3) -> None:
    """A tiny Llama (head_dim 32) trained from scratch on ``batch_texts()`` (a fresh batch per step),
    saved with its tokenizer to ``out``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    optim = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        batch = tokenizer(batch_texts(), return_tensors="pt", padding=True, add_special_tokens=False)
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        loss = model(**batch, labels=labels).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
    model.eval()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    save_pretrained(model, out)
    save_tokenizer(tokenizer, out)


if __name__ == "__main__":  # pragma: no cover - regenerating the shipped model
    import sys

    build_tiny_llama(Path(sys.argv[1]))
