"""What TRL scripts read from a trainer after ``train()``: the ``TrainOutput`` it returns and
``trainer.state`` with its ``log_history``, made from a finished run directory."""
from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..training.runlog import is_eval_row


@dataclass
class TrainerStateView:
    """The fields of transformers' ``TrainerState`` that scripts read after training."""

    global_step: int = 0
    max_steps: int = 0
    epoch: float = 0.0
    log_history: list[dict[str, Any]] = field(default_factory=list)


def _rows(run_dir: Path | None) -> list[dict[str, Any]]:
    if run_dir is None or not (run_dir / "metrics.jsonl").is_file():
        return []
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _steps(run_dir: Path | None, raw: dict[str, Any], rows: int) -> tuple[int, int]:
    """(optimizer updates per step of ours, the run's steps): TRL's steps are the updates, and a step of
    ours makes ``learner.epochs`` x its mini batches of them (``num_iterations``, ``steps_per_generation``)."""
    import yaml

    from ..config.loading import build_config

    saved = run_dir / "config.yaml" if run_dir is not None else None
    source = yaml.safe_load(saved.read_text()) if saved is not None and saved.is_file() else raw
    config = build_config({k: source.get(k) or {} for k in ("train", "generation", "learner")})
    return config.updates_per_step(), int((source.get("train") or {}).get("steps") or rows)


#: TRL's names in ``log_history`` for metrics of ours that are the same quantity
TRL_NAMES = {"loss": "loss/total", "reward": "reward/mean", "learning_rate": "lr",
             "completions/mean_length": "completion/length", "completions/min_length": "completion/min_length",
             "completions/max_length": "completion/max_length", "reward_std": "reward/std",
             "frac_reward_zero_std": "reward/zero_std_frac"}
#: the same where the run has them: terminated lengths, the policy term, the entropy bonus's coefficient, the
#: load-balancing loss, tool use (TRL's calls per completion and failures per call), the engine / learner mismatch
TRL_NAMES_IF = {"completions/mean_terminated_length": "completion/terminated_length",
                "completions/min_terminated_length": "completion/min_terminated_length",
                "completions/max_terminated_length": "completion/max_terminated_length",
                "policy_loss": "loss/policy", "entropy_coef": "entropy/coef", "aux_loss": "loss/router_aux",
                "tools/call_frequency": "env/tool_calls", "tools/failure_frequency": "env/tool_failure_rate",
                "sampling/sampling_logp_difference/mean": "mismatch/abs_log_ratio",
                "sampling/sampling_logp_difference/max": "mismatch/abs_log_ratio_max",
                **{f"sampling/importance_sampling_ratio/{k}": f"mismatch/weight_{k}" for k in ("min", "mean", "max")}}
#: TRL's clip_ratio/<name>_mean: the share of tokens clipped below the band, above it, and either
CLIP_NAMES = {"low": "loss/clip_low_frac", "high": "loss/clip_high_frac", "region": "loss/clip_frac"}
#: TRL's clip_ratio/low_min and /high_max: the smallest low share and the largest high share of a sequence
CLIP_EXTREMES = {"low_min": "loss/clip_low_seq_min", "high_max": "loss/clip_high_seq_max"}


def _trl_row(row: dict[str, Any], names: dict[str, str] | None = None) -> dict[str, Any]:
    """A ``metrics.jsonl`` row with TRL's names added (``rewards/<function>/mean`` and ``/std`` for each function,
    under the name TRL gives it -- ``names``: ours -> TRL's, e.g. a callable class's -- and ``clip_ratio/*_mean``
    for a clipped surrogate's)."""
    names = names or {}
    named = {f"rewards/{names.get(k[7:], k[7:])}/mean": v for k, v in row.items()
             if k.startswith("reward/") and k[7:] not in ("mean", "std", "shaped_mean", "retries", "zero_std_frac")}
    named.update({f"rewards/{names.get(k[11:], k[11:])}/std": v for k, v in row.items() if k.startswith("reward_std/")})
    if "completion/stopped" in row:  # TRL's share of completions that reached the length limit
        named["completions/clipped_ratio"] = 1.0 - row["completion/stopped"]
    if "loss/clip_low_frac" in row:  # the PPO-clip family's (TRL's loss types grpo, bnpo, dr_grpo, dapo, luspo)
        named.update({f"clip_ratio/{theirs}_mean": row[ours] for theirs, ours in CLIP_NAMES.items()})
        named.update({f"clip_ratio/{theirs}": row[ours] for theirs, ours in CLIP_EXTREMES.items() if ours in row})
    elif "loss/clip_high_frac" in row:  # CISPO's cap, where the advantage is positive
        named["cispo_clip_ratio"] = row["loss/clip_high_frac"]
    named.update({theirs: row[ours] for theirs, ours in TRL_NAMES_IF.items() if ours in row})
    return {**row, **named, **{theirs: row.get(ours) for theirs, ours in TRL_NAMES.items()}}


def _trl_eval_row(row: dict[str, Any]) -> dict[str, Any]:
    """A held-out evaluation row as TRL names it: ``eval_<name>`` for each of ours, and ``eval_reward``, the
    mean reward of the samples (our ``mean@k``)."""
    named = {f"eval_{k[5:]}": v for k, v in row.items() if k.startswith("eval/")}
    mean = next((v for k, v in row.items() if k.startswith("eval/mean@")), None)
    return {**named, **({"eval_reward": mean} if mean is not None else {})}


def trainer_state(run_dir: Path | None, raw: dict[str, Any], names: dict[str, str] | None = None) -> TrainerStateView:
    """``trainer.state``: the updates made and planned, the epoch, and ``log_history`` -- a dict per step (with
    TRL's ``num_tokens``, the prompt and completion tokens of the steps so far) and one per held-out evaluation
    after it (the one before the first step at step 0), at TRL's steps."""
    every = _rows(run_dir)
    rows = [r for r in every if "reward/mean" in r]
    per_step, steps = _steps(run_dir, raw, len(rows))
    seen = itertools.accumulate(r.get("tokens/step", 0.0) for r in rows)  # TRL's num_tokens: the tokens so far
    trained = [((int(r.get("step", i)) + 1) * per_step, 0, {**_trl_row(r, names), "num_tokens": n})
               for i, (r, n) in enumerate(zip(rows, seen))]
    evals = [(int(r.get("step", 0)) * per_step, 1, _trl_eval_row(r)) for r in every if is_eval_row(r)]
    history = [{**row, "step": step} for step, _, row in sorted(trained + evals, key=lambda t: t[:2])]
    epoch = float(rows[-1].get("epoch", 0.0)) if rows else 0.0  # passes over the prompts (runs before it: 0)
    return TrainerStateView(len(rows) * per_step, steps * per_step, epoch, history)


def train_output(run_dir: Path) -> Any:
    """transformers' ``TrainOutput(global_step, training_loss, metrics)`` of a finished run."""
    from transformers.trainer_utils import TrainOutput

    rows = [r for r in _rows(run_dir) if "reward/mean" in r]
    losses = [r["loss/total"] for r in rows if r.get("loss/total") is not None]
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    metrics = {"train_loss": sum(losses) / len(losses) if losses else 0.0, "run_dir": str(run_dir),
               **{k: v for k, v in summary.items() if isinstance(v, (int, float))}}
    updates = _steps(run_dir, {}, len(rows))[0]
    per_step = summary.get("seconds_per_step")
    if isinstance(per_step, (int, float)) and per_step > 0:  # transformers' names for the run's speed
        metrics.update(train_runtime=per_step * len(rows), train_steps_per_second=updates / per_step)
    return TrainOutput(len(rows) * updates, metrics["train_loss"], metrics)


class DriverAccelerator:
    """``trainer.accelerator`` as TRL's scripts use it after training (``print``, ``is_main_process``,
    ``wait_for_everyone``): the script runs once, in the driver, which starts every rank itself -- it is
    the main process."""

    is_main_process = is_local_main_process = True
    process_index = local_process_index = 0
    num_processes = 1

    def print(self, *args: Any, **kwargs: Any) -> None:
        print(*args, **kwargs)

    def wait_for_everyone(self) -> None:
        """Nothing to wait for: the ranks finished when ``train()`` returned."""


class AfterTraining:
    """What transformers' Trainer offers scripts after ``train()`` (TRL's own ``grpo.py``, open-r1's):
    ``accelerator``, ``log_metrics`` / ``save_metrics`` / ``save_state``, ``evaluate``,
    ``create_model_card``, ``end``; ``push_to_hub`` is one line (nothing is uploaded from here).
    The class that mixes it in sets ``run_dir`` (None before training), ``raw``, ``model_path`` and
    ``reward_names`` (ours -> TRL's, where they differ)."""

    run_dir: Path | None
    raw: dict[str, Any]
    model_path: str
    reward_names: dict[str, str]
    accelerator = DriverAccelerator()
    hub_model_id: str | None = None

    @property
    def output_dir(self) -> Path:
        return Path(self.raw.get("train", {}).get("output_dir") or "trainer_output")

    def log_metrics(self, split: str, metrics: dict[str, Any]) -> None:
        """Print ``metrics`` under a ``***** split metrics *****`` header, as transformers does."""
        print(f"***** {split} metrics *****")
        for key in sorted(metrics):
            print(f"  {key:<{max(map(len, metrics), default=0)}} = {metrics[key]}")

    def save_metrics(self, split: str, metrics: dict[str, Any], combined: bool = True) -> None:
        """``<output_dir>/<split>_results.json`` and, with ``combined``, merged into ``all_results.json``."""
        self.output_dir.mkdir(parents=True, exist_ok=True)
        (self.output_dir / f"{split}_results.json").write_text(json.dumps(metrics, indent=4, sort_keys=True))
        if combined:
            path = self.output_dir / "all_results.json"
            merged = {**(json.loads(path.read_text()) if path.is_file() else {}), **metrics}
            path.write_text(json.dumps(merged, indent=4, sort_keys=True))

    def save_state(self) -> None:
        """``<output_dir>/trainer_state.json``: the fields of ``trainer.state`` (log_history included)."""
        from dataclasses import asdict

        self.output_dir.mkdir(parents=True, exist_ok=True)
        state = trainer_state(self.run_dir, self.raw, self.reward_names)
        (self.output_dir / "trainer_state.json").write_text(json.dumps(asdict(state), indent=2, default=str))

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        """The run's last held-out evaluation (the trained policy on ``eval_dataset``), keyed ``eval_<name>``
        as transformers keys them."""
        from ..errors import ConfigError

        evals = [r for r in _rows(self.run_dir) if is_eval_row(r)]
        if not evals:
            raise ConfigError("evaluate() reads the run's held-out evaluation: pass eval_dataset to GRPOTrainer and "
                              "call it after train()")
        return _trl_eval_row(evals[-1])

    def create_model_card(self, model_name: str | None = None, dataset_name: str | None = None,
                          tags: list[str] | str | None = None, **kwargs: Any) -> None:
        """``<output_dir>/README.md``: the base model, the dataset, the method and the tags."""
        self.output_dir.mkdir(parents=True, exist_ok=True)
        tags = [tags] if isinstance(tags, str) else list(tags or [])
        lines = ["---", f"base_model: {self.model_path}", *([f"datasets: [{dataset_name}]"] if dataset_name else []),
                 f"tags: [{', '.join(['rlhf-plugins', 'grpo', *tags])}]", "---", "",
                 f"# {model_name or self.output_dir.name}", "",
                 f"Trained from `{self.model_path}` with GRPO by rlhf-plugins"
                 + (f" on `{dataset_name}`." if dataset_name else ".")]
        (self.output_dir / "README.md").write_text("\n".join(lines) + "\n")

    def push_to_hub(self, *args: Any, **kwargs: Any) -> None:
        from ..errors import ConfigError

        raise ConfigError(f"push_to_hub: rlhf-plugins uploads nothing; after save_model() upload the folder with "
                          f"`hf upload <repo> {self.output_dir}`")

    def end(self) -> None:
        """Nothing left to close: the run ended its trackers and process groups when ``train()`` returned."""
