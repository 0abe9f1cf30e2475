"""OpenRLHF users' command lines, here: every flag of ``train_ppo_ray``, ``train_sft``, ``train_rm``,
``train_dpo`` and ``serve_rm`` (0.9's flat spellings and 0.10+'s dotted ones) with our equivalent
(``assets/openrlhf_flags.yaml``): the one-line hint when such a flag reaches ``rlhf``, the converter
behind ``rlhf convert openrlhf -- <command line>``, and the table of docs/from_openrlhf.md.

The converter carries OpenRLHF's defaults where ours differ, so the converted run means what the
user's command meant (a GAE critic, one sample per prompt, KL in the reward with k1 at 0.01, ...).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

TABLE = Path(__file__).resolve().parent.parent / "assets" / "openrlhf_flags.yaml"
#: OpenRLHF's defaults (train_ppo_ray, 0.9-0.11) where they differ from ours: carried into a converted run
PPO_DEFAULTS: dict[str, Any] = {
    "placement.strategy": "ray",
    "learner.backend": "deepspeed",
    "deepspeed.zero_stage": 2,
    "model.dtype": "bfloat16",
    "algo.advantage.estimator": "gae",
    "algo.advantage.lam": 1.0,
    "generation.n_samples_per_prompt": 1,
    "generation.max_new_tokens": 1024,
    "data.max_prompt_tokens": 1024,
    "data.apply_chat_template": False,
    "algo.kl.coef": 0.01,
    "algo.kl.estimator": "k1",
    "algo.kl.in_reward": True,
    "critic.value_clip": 0.5,
    "critic.lr": 9e-6,
    "learner.lr": 1e-6,
    "learner.betas": [0.9, 0.95],
    "learner.warmup_ratio": 0.03,
    "learner.lr_scheduler": "cosine",
    "learner.min_lr_ratio": 0.1,
    "learner.disable_dropout": False,  # its Actor trains the model as loaded, dropout included
    "train.prompts_per_step": 1024,
    "train.episodes": 1,
    "learner.mini_batch_size": 128,
    "learner.micro_batch_size": 1,
    "reward.clip": 10.0,
    "train.seed": 42,
    "eval.temperature": 0.6,
    "eval.n_samples": 4,
    "vllm.gpu_memory_utilization": 0.95,
    "train.keep_checkpoints": 3,  # --ckpt.max_num's (with --save_steps)
}
COMMANDS = {"train_ppo_ray": "ppo", "train_sft": "sft", "train_rm": "rm", "train_dpo": "dpo", "serve_rm": "serve_rm"}
#: our command for each of theirs
OURS = {"ppo": "rlhf train", "sft": "rlhf sft", "rm": "rlhf rm", "dpo": "rlhf dpo", "serve_rm": "rlhf serve-reward"}
#: OpenRLHF commands without a conversion that have a neighbour here (OpenRLHF 0.8's, whose flags are not mapped)
NEARBY = {"train_kto": "; it left OpenRLHF in 0.9: rlhf kto runs TRL's KTOTrainer, with TRL's fields under --trl.*",
          "train_kd": "; it left OpenRLHF in 0.9: rlhf distill distils on the student's own samples (TRL's on-policy "
                      "distillation), not on the dataset's answers",
          "train_opd": "; its sampled-token mode (--opd.topk 0) has a counterpart in rlhf train: the teacher as "
                       "--model.reference_path and its KL as the reward (--reward.weights 0 --algo.kl.in_reward true "
                       "--algo.kl.estimator k1 --algo.kl.coef 1; docs/algorithms.md), its top-k mode nearest to rlhf "
                       "distill --model.teacher (TRL's divergence over the whole vocabulary)",
          "train_ppo": "; it is OpenRLHF's PPO without Ray, whose flags train_ppo_ray shares: convert the command "
                       "with openrlhf.cli.train_ppo_ray in its place (train_ppo_ray's defaults are carried where it "
                       "gives none; --placement.strategy local runs it in one process)"}


@dataclass(frozen=True)
class Flag:
    flags: tuple[str, ...]
    kind: str
    ours: tuple[str, ...] = ()
    note: str = ""
    switch: bool = False
    value: Any = None
    map: dict[str, Any] | None = None
    #: ``map`` translates a special value and carries any other as it is (else it lists every value converted)
    open_map: bool = False
    nargs: int | str | None = None
    sets: dict[str, Any] = field(default_factory=dict)
    role: str | None = None
    commands: tuple[str, ...] = ()
    stage: str | None = None
    stage_value: Any = None
    #: the rlhf serve-reward argument it is for serve_rm (the serve_rm-only rows: ``ours``)
    serve: str | None = None

    def unmapped(self, values: list[Any]) -> str | None:
        """Why a value of a flag mapped value by value is not converted (None: each value is)."""
        unknown = [v for v in values if self.map is not None and not self.open_map and str(v) not in self.map]
        return (f"{unknown[0]} has no equivalent here (converted: {', '.join(self.map or {})}); the config keeps "
                "the default (OpenRLHF's, where carried)") if unknown else None

    @property
    def target(self) -> str:
        return ", ".join(f"--{k}" if not k.startswith("--") else k for k in self.ours)


@functools.cache
def table() -> tuple[Flag, ...]:
    rows = yaml.safe_load(TABLE.read_text())
    out = []
    for row in rows:
        ours = row.pop("ours", ())
        row["ours"] = tuple(ours) if isinstance(ours, list) else ((ours,) if ours else ())
        row["flags"] = tuple(row["flags"])
        row["commands"] = tuple(row.get("commands", ()))
        out.append(Flag(**row))
    return tuple(out)


@functools.cache
def _index() -> dict[str, Flag]:
    return {name: flag for flag in table() for name in flag.flags}


def lookup(name: str) -> Flag | None:
    """The entry of an OpenRLHF flag, in any spelling, with or without its dashes."""
    name = name.split("=", 1)[0]
    return _index().get(name if name.startswith("--") else "--" + name)


def hint(name: str) -> str | None:
    """One line for an OpenRLHF flag given to rlhf: what it is here, or why there is none."""
    flag = lookup(name)
    if flag is None:
        return None
    spelled = name.split("=", 1)[0] if name.startswith("--") else "--" + name.split("=", 1)[0]
    if flag.kind == "none":
        return f"{spelled} is OpenRLHF's; it has no equivalent here: {flag.note}"
    target = flag.target or (f"--{flag.stage}" if flag.stage else "")
    if flag.switch and flag.value is not None and len(flag.ours) == 1:
        target = f"{target} {str(flag.value).lower() if isinstance(flag.value, bool) else flag.value}"
    elif flag.switch and len(flag.ours) == 1:
        target = f"{target} true"
    note = f" ({flag.note})" if flag.note and flag.kind == "partial" else ""
    return (f"{spelled} is OpenRLHF's; here it is {target}{note}; `rlhf convert openrlhf -- <command line>` "
            "converts a whole command")


INTRO = """# Coming from OpenRLHF

OpenRLHF's PPO-on-Ray recipe is the one rlhf-plugins re-implements: the same roles (actor, critic,
reference, reward, vLLM engines) on Ray placement groups, DeepSpeed ZeRO, bucketed weight sync. This
page maps every flag of OpenRLHF's `train_ppo_ray`, `train_sft`, `train_rm`, `train_dpo` and
`serve_rm` -- 0.9's flat spellings and 0.10+'s dotted ones -- to ours.

```bash
rlhf convert openrlhf -- python3 -m openrlhf.cli.train_ppo_ray --pretrain ... --actor_learning_rate 5e-7 ...
rlhf convert openrlhf -o ppo.yaml -- <the same command>    # then: rlhf train --config ppo.yaml
```

`rlhf convert openrlhf` writes the equivalent config for `rlhf train` (or `rlhf sft` / `rm` / `dpo` for
the other scripts; for `serve_rm`, the `rlhf serve-reward` command line), carries OpenRLHF's defaults
where ours differ so the run means what the command meant, and lists every flag it converted with a
difference or could not convert, with the reason. An OpenRLHF flag given to `rlhf` itself stops with one
line naming our equivalent (`--actor_learning_rate is OpenRLHF's; here it is --learner.lr`). OpenRLHF's other
scripts (`train_kto`, `train_prm`, `train_kd`, ... -- OpenRLHF 0.8's, gone from 0.9) have no equivalent: converting
one is one line saying so and naming the stage nearest to it (`rlhf kto`; for `train_kd`, which distils on a dataset's
answers, `rlhf distill`, TRL's on-policy distillation on the student's own). So is `train_opd` (on OpenRLHF's
main branch, in no release up to 0.11.2): its sampled-token mode has a counterpart in `rlhf train`, the teacher
as `--model.reference_path` and its KL as the only reward (docs/algorithms.md), its top-k mode is nearest to
`rlhf distill`; and `train_ppo`, PPO without Ray, whose command converts with `openrlhf.cli.train_ppo_ray` in its
place.

## Where the semantics differ

- **Batch sizes.** OpenRLHF's `--rollout_batch_size` counts prompts per rollout, each sampled
  `--n_samples_per_prompt` times: our `--train.prompts_per_step` and `--generation.n_samples_per_prompt`.
  `--train_batch_size` is samples per optimizer step over all ranks: our `--learner.mini_batch_size`;
  `--micro_train_batch_size` is per rank and forward: our `--learner.micro_batch_size`.
- **Ranks.** `--actor_num_nodes x --actor_num_gpus_per_node` is our `--ray.actor_workers` (likewise
  critic, reference, reward); `--ray.strategy SPREAD` spreads them over nodes.
- **KL.** OpenRLHF puts KL in the reward (k1, coefficient 0.01) unless `--use_kl_loss`; our default
  is KL in the loss (k3, 0.001). The converter carries OpenRLHF's choice (`algo.kl.in_reward: true`,
  `estimator: k1`, `coef: 0.01`).
- **Defaults.** OpenRLHF defaults to GAE with a critic, one sample per prompt, bf16, ZeRO-2, lr 1e-6
  (critic 9e-6) with 3% warm-up and cosine decay to a tenth, value clip 0.5, lambda 1.0, reward clip
  10, seed 42; the converter writes each of these where ours differ. (A model of 50M parameters or
  more gets the learning-rate part here by itself: docs/memory.md.)
- **The stages.** `train_sft`, `train_rm` and `train_dpo` become `rlhf sft` / `rm` / `dpo`, which run
  TRL's trainers: the global `--train_batch_size` (128 by default) is TRL's per-device batch
  (`--micro_train_batch_size`) times `gradient_accumulation_steps` on one process (divide that by N under
  `accelerate launch` with N processes); OpenRLHF's cosine decay to a tenth after a 3% warm-up and Adam betas
  (0.9, 0.95) are carried as TRL's `lr_scheduler_type` / `warmup_steps` / `adam_beta1` / `adam_beta2`, and
  each script's learning rate (SFT 5e-6, RM 9e-6, DPO 1e-5), epochs (2, 1, 1) and `--max_len` (2048, 512, 512)
  as TRL's `learning_rate`, `num_train_epochs` and `max_length` where the command gives none;
  DPO's `--nll_loss_coef` is TRL's loss list `[sigmoid, sft]` weighted `[1, coef]`.
- **Reward normalization.** A reward model's stored mean/std (OpenRLHF's `normalize_reward` config)
  is applied when the run asks for it with `--reward.model_normalize` (OpenRLHF: `--normalize_reward`);
  `--reward.normalize` also normalises every score by running statistics.
- **Models and data** are local folders and files (no hub names): download them first.

## Every flag

| OpenRLHF | here | | note |
|---|---|---|---|
"""


def markdown() -> str:
    """docs/from_openrlhf.md: the introduction and one table row per entry of the flag table."""
    rows = []
    for flag in table():
        names = " ".join(f"`{n}`" for n in flag.flags)
        here = flag.target or (f"--{flag.stage}" if flag.stage else "")
        if flag.switch and flag.value is not None and len(flag.ours) == 1:
            here = f"{here} {str(flag.value).lower() if isinstance(flag.value, bool) else flag.value}"
        if flag.stage and flag.ours:
            here = f"{here} (stages: --{flag.stage})"
        kind = {"same": "same", "partial": "partly", "none": "none"}[flag.kind]
        rows.append(f"| {names} | {f'`{here}`' if here else '-'} | {kind} | {flag.note} |")
    return INTRO + "\n".join(rows) + "\n"


if __name__ == "__main__":  # pragma: no cover - regenerating the page
    print(markdown(), end="")
