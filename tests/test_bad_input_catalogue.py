"""A catalogue of bad input and faults, each with the exact line it gets: exit status 2 (1 for a
dead role), one line, nothing half-written (no run directory unless a step completed)."""
from __future__ import annotations

import json
import os
import sys
import textwrap
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from tests.helpers import metrics_of, random_llama, short_run, the_run

#: (id, arguments, the whole error line after "rlhf: error: ") -- plain flags
FLAGS = [
    ("seed-negative", ["--train.seed", "-1"], "config key 'train.seed' must be >= 0 and <= 4.29497e+09; got -1"),
    ("threads-negative", ["--train.num_threads", "-3"], "config key 'train.num_threads' must be >= 0; got -3"),
    ("lr-inf", ["--learner.lr", "inf"], "config key 'learner.lr' must be a finite number; got inf"),
    ("lr-nan", ["--learner.lr", "nan"], "config key 'learner.lr' must be a finite number; got nan"),
    ("lr-zero", ["--learner.lr", "0"], "config key 'learner.lr' must be > 0; got 0.0"),
    ("lr-word", ["--learner.lr", "fast"], "config key 'learner.lr' expects a number, got 'fast'"),
    ("fp16-on-cpu", ["--model.dtype", "float16"],
     "model.dtype float16 needs a GPU (on a CPU it trains to NaN at the first step); use float32 or bfloat16"),
    ("dtype-unknown", ["--model.dtype", "float64"],
     "config key 'model.dtype' must be one of 'float32' | 'bfloat16' | 'float16'; got 'float64'"),
    ("eval-samples-without-evaluation", ["--eval.log_samples", "true", "--eval.enabled", "false"],
     "eval.log_samples writes the held-out evaluations' samples and this run evaluates on nothing: give --eval.path "
     "or --eval.split (and keep --eval.enabled true)"),
    ("print-samples-alone", ["--train.print_samples", "4"],
     "train.print_samples (4) prints the samples of the steps train.log_samples_every picks; set "
     "--train.log_samples_every N (every N steps) as well"),
    ("run-name-up", ["--train.run_name", "../x"],
     "train.run_name '../x' must be a plain folder name inside train.output_dir (no '/' or '..')"),
    ("run-name-absolute", ["--train.run_name", "/tmp/x"],
     "train.run_name '/tmp/x' must be a plain folder name inside train.output_dir (no '/' or '..')"),
    ("lora-rank-negative", ["--lora.rank", "-1"], "config key 'lora.rank' must be >= 0; got -1"),
    ("lora-dropout", ["--lora.dropout", "1"], "config key 'lora.dropout' must be >= 0 and < 1; got 1.0"),
    ("ray-workers-zero", ["--placement.strategy", "ray", "--ray.actor_workers", "0"],
     "config key 'ray.actor_workers' must be >= 1; got 0"),
    ("ray-timeout-negative", ["--placement.strategy", "ray", "--ray.ready_timeout", "-1"],
     "config key 'ray.ready_timeout' must be > 0; got -1.0"),
    ("vllm-memory", ["--vllm.gpu_memory_utilization", "1.5"],
     "config key 'vllm.gpu_memory_utilization' must be > 0 and <= 1; got 1.5"),
    ("vllm-dtype-verify", ["--generation.backend", "vllm", "--vllm.dtype", "auto", "--sync.verify", "true"],
     "--sync.verify checks that engine and learner log-probs agree to 1e-4, which an engine in vllm.dtype auto cannot "
     "against a float32 learner; drop --sync.verify or set --vllm.dtype model"),
    ("vllm-dtype-unknown", ["--vllm.dtype", "float64"],
     "config key 'vllm.dtype' must be one of 'model' | 'auto' | 'float32' | 'bfloat16' | 'float16'; got 'float64'"),
    ("zero-stage", ["--deepspeed.zero_stage", "4"], "config key 'deepspeed.zero_stage' must be >= 0 and <= 3; got 4"),
    ("temperature-zero", ["--generation.temperature", "0"], "config key 'generation.temperature' must be > 0; got 0.0"),
    ("top-p-zero", ["--generation.top_p", "0"], "config key 'generation.top_p' must be > 0 and <= 1; got 0.0"),
    ("steps-zero", ["--train.steps", "0"], "config key 'train.steps' must be >= 1; got 0"),
    ("reward-timeout", ["--reward.timeout", "-5"], "config key 'reward.timeout' must be >= 0; got -5.0"),
    ("aggregation", ["--algo.policy_loss.aggregation", "foo"],
     "unknown loss aggregation 'foo'; choose one of: token-mean, seq-mean-token-sum, seq-mean-token-mean, "
     "seq-mean-token-sum-norm (--algo.policy_loss.aggregation)"),
    ("clip-low-alone", ["--reward.clip_low", "0"],
     "reward.clip_low (0.0) is the lower bound of a clip: give --reward.clip above it (none given)"),
    ("overlong-buffer", ["--reward.overlong_buffer", "40", "--generation.max_new_tokens", "8"],
     "reward.overlong_buffer (40) must not exceed generation.max_new_tokens (8)"),
    ("filtering-one-sample", ["--reward.dynamic_filtering", "true", "--generation.n_samples_per_prompt", "1"],
     "reward.dynamic_filtering compares samples of one prompt and needs generation.n_samples_per_prompt >= 2"),
    ("filter-range", ["--reward.filter_range", "[0.5, 0.1]"],
     "reward.filter_range must be [low, high] with low < high; got [0.5, 0.1]"),
    ("adaptive-kl-zero", ["--algo.kl.controller", "adaptive", "--algo.kl.coef", "0"],
     "an adaptive KL controller needs a starting algo.kl.coef > 0"),
    ("staleness-uncorrected", ["--train.max_staleness", "1"],
     "train.max_staleness 1 trains on samples of policies up to 1 update behind the learner, and "
     "algo.policy_loss.mismatch is none, so nothing corrects for it; use --algo.policy_loss.mismatch tis (or icepop, "
     "seq_mask_tis), or --train.allow_uncorrected_staleness true to train uncorrected"),
    ("partial-without-async", ["--generation.partial_rollout", "true"],
     "generation.partial_rollout swaps weights during a generation, which needs asynchronous training; set "
     "--train.max_staleness 1 (or more), or drop partial_rollout"),
    ("vllm-temperature", ["--generation.backend", "vllm", "--generation.temperature", "3"],
     "generation.temperature 3 is above 2, which vLLM refuses to sample at; lower it, or use --generation.backend "
     "transformers"),
    ("vllm-eval-temperature", ["--generation.backend", "vllm", "--eval.temperature", "2.5"],
     "eval.temperature 2.5 is above 2, which vLLM refuses to sample at; lower it, or use --generation.backend "
     "transformers"),
    ("stop-empty", ["--generation.stop", '["</answer>", ""]'],
     "generation.stop holds an empty string, which would end every completion at once; remove it"),
    ("stop-partial-rollout", ["--generation.stop", '["</answer>"]', "--generation.partial_rollout", "true",
                              "--train.max_staleness", "1", "--algo.policy_loss.mismatch", "tis"],
     "generation.stop is matched within one generation call, and a partial rollout generates in chunks; drop one "
     "of them"),
    ("betas", ["--learner.betas", "[0.9, 1.5]"],
     "config key 'learner.betas' must be two numbers in [0, 1), e.g. [0.9, 0.999]; got [0.9, 1.5]"),
    ("critic-betas", ["--critic.betas", "[0.9]"],
     "config key 'critic.betas' must be two numbers in [0, 1), e.g. [0.9, 0.999]; got [0.9]"),
    ("optimizer", ["--learner.optimizer", "lion"],
     "config key 'learner.optimizer' must be one of 'adamw' | 'adam' | 'sgd' | 'muon' | 'adafactor'; got 'lion'"),
    ("scheduler", ["--learner.lr_scheduler", "poly"],
     "config key 'learner.lr_scheduler' must be one of 'constant' | 'linear' | 'cosine'; got 'poly'"),
    ("weights-count", ["--reward.weights", "1,2"],
     "reward.weights has 2 values for 1 reward sources (1 functions, 0 models); give one per source"),
    ("remote-url", ["--reward.remote_urls", "ftp://x"], "reward.remote_urls entry 'ftp://x' is not an http(s) URL"),
    ("remote-url-file", ["--reward.remote_urls", "reward_func.py"], "reward.remote_urls entry 'reward_func.py' is a "
     "Python file, not a server; load it with --plugin reward_func.py and name its function in --reward.functions"),
    ("ipc-locally", ["--sync.method", "ipc"],
     "weight sync 'ipc' needs the engine in its own process, which placement 'local' does not do; use --sync.method inprocess"),
    ("lora-adapter-not-an-adapter", ["--lora.adapter", "nowhere"],
     "lora.adapter 'nowhere' is not a trained LoRA adapter's folder (adapter_config.json and "
     "adapter_model.safetensors, as PEFT's save_pretrained and a LoRA run's final/ hold)"),
    ("lora-adapter-and-rank", ["--lora.adapter", "nowhere", "--lora.rank", "4"],
     "lora.adapter takes the trained adapter's own config: drop --lora.config and --lora.rank"),
    ("adapter-without-lora", ["--sync.method", "adapter"],
     "weight sync 'adapter' moves a LoRA adapter alone: set --lora.rank (or --lora.config), or choose another --sync.method"),
    ("placement-unknown", ["--placement.strategy", "slurm"],
     "unknown placement strategy 'slurm'; choose one of: local, ray (--placement.strategy)"),
    ("learner-unknown", ["--learner.backend", "megatron"],
     "unknown learner backend 'megatron'; choose one of: deepspeed, fsdp, torch (--learner.backend)"),
    ("kl-unknown", ["--algo.kl.estimator", "k9"], "unknown kl estimator 'k9'; choose one of: k1, k2, k3 (--algo.kl.estimator)"),
    ("loss-unknown", ["--algo.policy_loss.name", "opo"],
     "unknown policy loss 'opo'; choose one of: cispo, gspo, ppo, sapo, sequence_ppo, vespo (--algo.policy_loss.name)"),
    ("divergence-gate-without-a-mask", ["--algo.policy_loss.mismatch", "tis", "--algo.policy_loss.mismatch_gate",
                                        "binary_kl"],
     "algo.policy_loss.mismatch_gate binary_kl gates the tokens or sequences that icepop and seq_icepop keep; mismatch "
     "tis keeps no such choice: use --algo.policy_loss.mismatch icepop (per token) or seq_icepop (per sequence)"),
    ("ratio-level-of-ppo", ["--algo.policy_loss.ratio_level", "sequence"],
     "algo.policy_loss.ratio_level sequence applies to cispo and sapo; 'ppo' has none (PPO on sequence ratios is "
     "--algo.policy_loss.name gspo or sequence_ppo): drop --algo.policy_loss.ratio_level"),
    ("dual-clip-without-a-clip", ["--algo.policy_loss.name", "cispo", "--algo.policy_loss.dual_clip", "3"],
     "algo.policy_loss.dual_clip bounds the clipped surrogate of ppo, gspo and sequence_ppo; 'cispo' has no clip to "
     "bound: remove --algo.policy_loss.dual_clip"),
    ("whitening-twice", ["--algo.advantage.estimator", "reinforce", "--algo.advantage.normalize_advantages", "true"],
     "algo.advantage.normalize_advantages whitens sequence advantages; estimator 'reinforce' whitens its token "
     "advantages already (--algo.advantage.std_norm): drop --algo.advantage.normalize_advantages"),
    ("vespo-sequence-correction", ["--algo.policy_loss.name", "vespo", "--algo.policy_loss.mismatch", "seq_mask"],
     "algo.policy_loss.name vespo takes token mismatch weights into its sequence weight; algo.policy_loss.mismatch "
     "seq_mask is not a token weight: use tis or icepop"),
    ("entropy-bounds-reversed", ["--algo.policy_loss.entropy_target", "0.5", "--algo.policy_loss.entropy_coef_min",
                                 "0.2", "--algo.policy_loss.entropy_coef_max", "0.1"],
     "algo.policy_loss.entropy_coef_min (0.2) must not exceed entropy_coef_max (0.1)"),
    ("fp32-head-deepspeed", ["--learner.backend", "deepspeed", "--model.dtype", "bfloat16", "--model.fp32_lm_head",
                             "true"],
     "model.fp32_lm_head: the 'deepspeed' learner trains every weight in model.dtype; use --learner.backend torch "
     "(or fsdp) or drop --model.fp32_lm_head"),
    ("vllm-regex-invalid", ["--generation.backend", "vllm", "--vllm.structured_outputs_regex", "[0-9"],
     "vllm.structured_outputs_regex '[0-9' is not a regular expression (unterminated character set at position 0); "
     "fix it or drop it"),
    ("fp32-head-vllm-verify", ["--generation.backend", "vllm", "--model.dtype", "bfloat16", "--model.fp32_lm_head",
                               "true", "--sync.verify", "true"],
     "--sync.verify checks that engine and learner log-probs agree to 1e-4, which vLLM's bfloat16 output head cannot "
     "against the learner's float32 one (--model.fp32_lm_head); drop one of them"),
    ("fp32-head-lora-head", ["--lora.rank", "4", "--lora.target_modules", "[q_proj, lm_head]", "--model.fp32_lm_head",
                             "true"],
     "model.fp32_lm_head keeps the output head a plain float32 layer, and the LoRA config adapts lm_head "
     "(target_modules or modules_to_save); leave lm_head out of it or drop --model.fp32_lm_head"),
    ("compile-mode-alone", ["--learner.compile_mode", "reduce-overhead"],
     "learner.compile_mode reduce-overhead says how --learner.compile compiles; add --learner.compile true or drop "
     "--learner.compile_mode"),
    ("cuda-graphs-on-fsdp", ["--learner.backend", "fsdp", "--learner.compile", "true", "--learner.compile_mode",
                             "reduce-overhead"],
     "learner.compile_mode reduce-overhead replays CUDA graphs, which the 'fsdp' learner does not allow (its weights "
     "move between steps); use --learner.compile_mode default (or max-autotune-no-cudagraphs) or --learner.backend torch"),
    ("adafactor-on-fsdp", ["--learner.optimizer", "adafactor", "--learner.backend", "fsdp"],
     "learner.optimizer adafactor factors each weight matrix's second moment by its rows and columns, which the "
     "fsdp learner's flattened or sharded parameters do not keep: use --learner.backend torch, or another optimizer"),
    ("muon-decay-on-deepspeed", ["--learner.optimizer", "muon", "--learner.backend", "deepspeed",
                                 "--learner.weight_decay", "0.1"],
     "DeepSpeed's Muon decays every parameter, biases and normalisation weights too: add --learner.weight_decay_all "
     "true to accept that, or use --learner.weight_decay 0 or another backend"),
    ("critic-muon-decay-on-deepspeed", ["--algo.advantage.estimator", "gae", "--critic.optimizer", "muon",
                                        "--learner.backend", "deepspeed", "--critic.weight_decay", "0.1"],
     "DeepSpeed's Muon decays every parameter, biases and normalisation weights too: add --learner.weight_decay_all "
     "true to accept that, or use --critic.weight_decay 0 or another backend"),
    ("critic-adafactor-on-fsdp", ["--algo.advantage.estimator", "gae", "--critic.optimizer", "adafactor",
                                  "--learner.backend", "fsdp"],
     "critic.optimizer adafactor factors each weight matrix's second moment by its rows and columns, which the "
     "fsdp learner's flattened or sharded parameters do not keep: use --learner.backend torch, or another optimizer"),
    ("muon-steps-on-deepspeed", ["--learner.optimizer", "muon", "--learner.backend", "deepspeed",
                                 "--learner.muon_ns_steps", "6"],
     "DeepSpeed's Muon runs 5 Newton-Schulz steps with Nesterov momentum; leave learner.muon_ns_steps and "
     "learner.muon_nesterov at their defaults with --learner.backend deepspeed"),
    ("critic-muon-steps-on-deepspeed", ["--algo.advantage.estimator", "gae", "--critic.optimizer", "muon",
                                        "--learner.backend", "deepspeed", "--critic.muon_nesterov", "false"],
     "DeepSpeed's Muon runs 5 Newton-Schulz steps with Nesterov momentum; leave critic.muon_ns_steps and "
     "critic.muon_nesterov at their defaults with --learner.backend deepspeed"),
    ("kl-unbiased-gradient-in-reward", ["--algo.kl.unbiased_gradient", "true", "--algo.kl.in_reward", "true"],
     "algo.kl.unbiased_gradient shapes the KL loss term's gradient, and algo.kl.in_reward puts KL in the reward "
     "instead; drop one of them"),
    ("kl-unbiased-gradient-with-ratio", ["--algo.kl.unbiased_gradient", "true", "--algo.kl.ratio", "sequence"],
     "algo.kl.unbiased_gradient weighs the KL gradient by pi/pi_old itself; drop --algo.kl.ratio sequence"),
    ("gdpo-one-sample", ["--reward.combine", "normalize_then_sum", "--generation.n_samples_per_prompt", "1"],
     "reward.combine normalize_then_sum normalises each reward within its prompt group and needs "
     "generation.n_samples_per_prompt >= 2"),
    ("engines-locally", ["--generation.backend", "vllm", "--vllm.num_engines", "2"],
     "2 generation engines need a placement that runs several ranks per role; placement 'local' runs one (use "
     "--placement.strategy ray)"),
    ("torch-two-ranks", ["--placement.strategy", "ray", "--ray.actor_workers", "2"],
     "learner backend 'torch' runs one rank; choose a multi-rank learner (--learner.backend deepspeed) for "
     "ray.actor_workers 2 / ray.critic_workers 1"),
    ("ray-address-garbage", ["--placement.strategy", "ray", "--ray.address", "garbage"],
     "ray.address 'garbage' is not an address; give HOST:PORT (e.g. 127.0.0.1:6379), ray://HOST:PORT, auto, or leave "
     "it empty to start a local cluster"),
    ("builtin-data-unknown", ["--data.path", "builtin:nope"],
     "unknown built-in dataset 'nope'; choose one of: builtin:addition, builtin:addition-train, builtin:addition-test, builtin:calculator, builtin:calculator-train, builtin:calculator-test"),
    ("input-template-without-place", ["--data.apply_chat_template", "false", "--data.input_template", "Q: "],
     "data.input_template must hold one {} where the prompt goes (a literal brace doubled: {{ }}), e.g. "
     "'User: {}\\nAssistant: '; got 'Q: '"),
    ("input-template-two-places", ["--data.apply_chat_template", "false", "--data.input_template", "{} {}"],
     "data.input_template must hold one {} where the prompt goes (a literal brace doubled: {{ }}), e.g. "
     "'User: {}\\nAssistant: '; got '{} {}'"),
    ("input-template-with-chat-template", ["--data.input_template", "Q: {}"],
     "data.input_template puts plain-text prompts in place, but data.apply_chat_template renders every prompt with "
     "the tokenizer's chat template; add --data.apply_chat_template false (OpenRLHF's default) or drop "
     "--data.input_template"),
    ("system-prompt-without-chat-template", ["--data.system_prompt", "Add.", "--data.apply_chat_template", "false"],
     "data.system_prompt is a chat message, which only the chat template renders; drop --data.system_prompt or "
     "leave --data.apply_chat_template true"),
    ("probs-without-datasets", ["--data.probs", "0.5,0.5"],
     "data.probs weighs the datasets of data.path; name them there, comma-separated"),
    ("probs-for-another-count", ["--data.path", "builtin:addition-train,builtin:addition-test", "--data.probs", "1"],
     "data.probs [1.0] must give each of the 2 datasets of data.path a probability >= 0 (not all 0), in their order"),
    ("probs-all-zero", ["--data.path", "builtin:addition-train,builtin:addition-test", "--data.probs", "0,0"],
     "data.probs [0.0, 0.0] must give each of the 2 datasets of data.path a probability >= 0 (not all 0), in their "
     "order"),
    ("one-of-several-datasets-missing", ["--data.path", "builtin:addition-train,nowhere.jsonl"],
     "dataset 'nowhere.jsonl' does not exist; set --data.path to a .jsonl, .json, .csv, .parquet or .arrow file or folder"),
    ("model-a-hub-name", ["--model.path", "Qwen/Qwen2.5-0.5B"],
     "model.path 'Qwen/Qwen2.5-0.5B' does not exist here; if it names a Hugging Face Hub model, download it "
     "(hf download Qwen/Qwen2.5-0.5B --local-dir DIR) and give DIR"),
    ("reward-model-a-hub-name", ["--reward.models", "OpenRLHF/Llama-3-8b-rm-mixture"],
     "reward model 'OpenRLHF/Llama-3-8b-rm-mixture' does not exist here; if it names a Hugging Face Hub model, download "
     "it (hf download OpenRLHF/Llama-3-8b-rm-mixture --local-dir DIR) and give DIR"),
    ("data-a-hub-name", ["--data.path", "trl-lib/Capybara"],
     "dataset 'trl-lib/Capybara' does not exist here; if it names a Hugging Face Hub dataset, download it "
     "(hf download --repo-type dataset trl-lib/Capybara --local-dir DIR) and set --data.path DIR"),
    ("max-samples-negative", ["--data.max_samples", "-1"], "config key 'data.max_samples' must be >= 0; got -1"),
    ("unknown-key", ["--train.stepz", "3"], "unknown config key 'train.stepz'; did you mean 'train.steps'?"),
    ("flag-without-value", ["--train.steps"], "flag '--train.steps' needs a value, e.g. --train.steps VALUE"),
    ("resume-nowhere", ["--resume", "nowhere"], "--resume 'nowhere' does not exist; give a run directory or a checkpoint folder"),
    ("resume-not-a-run", ["--resume", "."],
     "--resume '.' is neither a run directory (config.yaml) nor a checkpoint folder; give one"),
    ("plugin-not-a-module-name", ["--plugin", "."], "unknown plugin '.': it is not an entry point of group "
     "'rlhf_plugins', an importable module or a .py file; check the name or pip install the plugin"),
    ("best-metric-unknown", ["--train.best_metric", "eval/pass@3"],
     "train.best_metric 'eval/pass@3' is not an evaluation metric; choose one of: eval/pass@1, eval/pass@8, eval/mean@8, "
     "eval/maj@8, eval/greedy"),
    ("best-metric-without-eval", ["--train.best_metric", "eval/pass@1", "--eval.enabled", "false"],
     "train.best_metric 'eval/pass@1' needs held-out evaluation: give --eval.path or --eval.split (and keep "
     "--eval.enabled true)"),
    ("eval-reward-unknown", ["--eval.reward_functions", "nope"],
     "unknown reward function 'nope'; choose one of: env_reward, exact_match (--eval.reward_functions)"),
    ("eval-split-all", ["--eval.split", "1"], "config key 'eval.split' must be >= 0 and < 1; got 1.0"),
    ("eval-data-missing", ["--eval.path", "nowhere.jsonl"],
     "dataset 'nowhere.jsonl' does not exist; set --eval.path to a .jsonl, .json, .csv, .parquet or .arrow file or folder"),
]

#: (id, arguments of ``rlhf eval``, the whole error line) -- nothing is written
EVAL_FLAGS = [
    ("eval-model-missing", ["--model", "nowhere"],
     "--model 'nowhere' is not a folder; give a run directory or a save_pretrained folder"),
    ("eval-model-a-hub-name", ["--model", "Qwen/Qwen2.5-0.5B"],
     "--model 'Qwen/Qwen2.5-0.5B' does not exist here; if it names a Hugging Face Hub model, download it "
     "(hf download Qwen/Qwen2.5-0.5B --local-dir DIR) and give DIR"),
    ("eval-model-not-a-model", ["--model", "."],
     "--model '.' is neither a run directory (config.yaml) nor a save_pretrained folder (config.json); give one"),
    ("eval-without-data", ["--data.path", "builtin:addition-test"],  # data with no held-out split of its own
     "no held-out prompts: give --data PATH (or --eval.path, or --eval.split to hold out part of --data.path)"),
    ("eval-output-nowhere", ["--output", "no/such/folder/r.json"],
     "cannot write the report to 'no/such/folder/r.json': no such folder; choose another --output"),
]


def error_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip() and not line.startswith("rlhf: warning:")]
    assert len(lines) == 1, err
    assert lines[0].startswith("rlhf: error: "), err
    return lines[0].removeprefix("rlhf: error: ")


def no_run_dirs() -> bool:
    return not Path("runs").exists() or not any(Path("runs").iterdir())


@pytest.mark.parametrize("args, expected", [c[1:] for c in FLAGS], ids=[c[0] for c in FLAGS])
def test_flags(rlhf, args, expected):
    code, _, err = rlhf("train", *args)
    assert code == 2
    assert error_line(err) == expected
    assert no_run_dirs()


@pytest.mark.parametrize("args, expected", [c[1:] for c in EVAL_FLAGS], ids=[c[0] for c in EVAL_FLAGS])
def test_eval_flags(rlhf, args, expected):
    code, _, err = rlhf("eval", *args)
    assert code == 2
    assert error_line(err) == expected
    assert list(Path(".").iterdir()) == []  # no report, no run


def write(path: Path, data: bytes | str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return path


def on_data(path: Path, *extra: str) -> list[str]:
    """The flags of a run on the dataset at ``path``, scored by exact_match."""
    return ["--data.path", str(path), "--reward.functions", "exact_match", *extra]


def rows(path: Path, items: list) -> Path:
    return write(path, "".join(json.dumps(r) + "\n" for r in items))


#: (id, builder(tmp) -> (args, expected line with {tmp} for the temporary folder))
def _files() -> list:
    cases = []

    def case(name):
        def add(fn):
            cases.append((name, fn))
            return fn
        return add

    @case("yaml-not-utf8")
    def _(t):
        write(t / "c.yaml", b"train:\n  steps: \xff\xfe\n")
        return ["--config", str(t / "c.yaml")], f"config file '{t}/c.yaml' is not UTF-8 text (byte 16); save it as UTF-8"

    @case("yaml-a-list")
    def _(t):
        write(t / "c.yaml", "- 1\n- 2\n")
        return ["--config", str(t / "c.yaml")], f"config file '{t}/c.yaml' must hold a mapping of sections, got list"

    @case("yaml-missing")
    def _(t):
        return ["--config", str(t / "none.yaml")], f"config file '{t}/none.yaml' does not exist"

    @case("yaml-a-python-file")
    def _(t):
        write(t / "reward.py", "def reward(prompts, completions, **kw):\n    return [0.0] * len(completions)\n")
        return ["--config", str(t / "reward.py")], f"config file '{t}/reward.py' is Python, not YAML; a reward or " \
            f"other plugin in a .py file is loaded with --plugin {t}/reward.py"

    @case("yaml-a-folder")
    def _(t):
        return ["--config", str(t)], f"config file '{t}' is a folder; give a YAML file"

    @case("yaml-a-run-directory")
    def _(t):
        write(t / "r" / "config.yaml", "train:\n  steps: 2\n")
        return ["--config", str(t / "r")], \
            f"config file '{t}/r' is a folder; give a YAML file (a run's is its config.yaml: '{t}/r/config.yaml')"

    @case("resume-before-the-first-checkpoint")
    def _(t):
        write(t / "r" / "config.yaml", "train:\n  steps: 2\n")
        return ["--resume", str(t / "r")], f"run directory '{t}/r' has no complete checkpoint to resume from (nothing " \
            f"under {t}/r/checkpoints); it stopped before its first checkpoint"

    @case("resume-a-folder-of-runs")
    def _(t):
        write(t / "runs" / "a" / "config.yaml", "train:\n  steps: 2\n")
        return ["--resume", str(t / "runs")], f"--resume '{t}/runs' is neither a run directory (config.yaml) nor a " \
            "checkpoint folder; it holds run directories (a); give one"

    @case("data-not-utf8")
    def _(t):
        write(t / "d.jsonl", b'{"prompt": "\xff\xfe 1+1="}\n')
        return on_data(t / "d.jsonl"), \
            f"dataset file '{t}/d.jsonl' is not UTF-8 text; convert it (e.g. iconv -t UTF-8)"

    @case("prompt-int")
    def _(t):
        rows(t / "d.jsonl", [{"prompt": 5, "label": "5"}])
        return on_data(t / "d.jsonl"), \
            f"dataset '{t}/d.jsonl' row 1: 'prompt' is int '5'; a prompt is a string or a list of chat messages " \
            '{"role": ..., "content": ...}'

    @case("prompt-mixed")
    def _(t):
        rows(t / "d.jsonl", [{"prompt": "1+1=", "label": "2"}, {"prompt": ["x", 3], "label": "2"}])
        return on_data(t / "d.jsonl"), None

    @case("prompt-dict")
    def _(t):
        rows(t / "d.jsonl", [{"prompt": {"text": "1+1="}, "label": "2"}])
        return on_data(t / "d.jsonl"), \
            f"dataset '{t}/d.jsonl' row 1: 'prompt' is dict \"{{'text': '1+1='}}\"; a prompt is a string or a list of " \
            'chat messages {"role": ..., "content": ...}'

    @case("chat-message-malformed")
    def _(t):
        rows(t / "d.jsonl", [{"prompt": [{"role": "user", "text": "1+1="}], "label": "2"}])
        return on_data(t / "d.jsonl"), \
            f"dataset '{t}/d.jsonl' row 1: 'prompt' holds a chat message that is not {{\"role\": str, \"content\": " \
            "str}: \"{'role': 'user', 'text': '1+1='}\""

    @case("data-no-prompt-column")
    def _(t):
        rows(t / "d.jsonl", [{"question": "1+1=", "label": "2"}])
        return on_data(t / "d.jsonl"), \
            f"dataset '{t}/d.jsonl' has no 'prompt' column (columns: question, label); set --data.prompt_key"

    @case("data-malformed-jsonl")
    def _(t):
        write(t / "d.jsonl", '{"prompt": "1+1=", "label": "2"}\n{"prompt": "2+2=", "label": \n')
        return on_data(t / "d.jsonl"), \
            f"dataset file '{t}/d.jsonl' line 2 is not valid JSON (Expecting value, column 29); each line must be " \
            "one JSON object"

    @case("input-template-on-chat-messages")
    def _(t):
        rows(t / "d.jsonl", [{"prompt": [{"role": "user", "content": "1+1="}], "label": "2"}])
        return on_data(t / "d.jsonl", "--data.template_strings", "false", "--data.input_template", "Q: {}"), \
            f"data.input_template puts plain-text prompts in place, but every prompt of '{t}/d.jsonl' is chat " \
            "messages, which the chat template renders; drop --data.input_template"

    #: one data file each: (id, its name, its content, the line; {t} is the temporary folder, None: the library's
    #: wording inside, the start and the file checked)
    for name, file, content, line in (
        ("data-txt", "d.txt", "1+1=\n",
         "dataset file '{t}/d.txt' has an unsupported type; use .jsonl, .json, .csv, .parquet or .arrow"),
        ("data-csv-unreadable", "d.csv", 'prompt,label\n"1+1=,2\n',
         "dataset '{t}/d.csv' cannot be read as CSV: ParserError: Error tokenizing data. C error: EOF inside string "
         "starting at row 1; mend the file or write it again"),
        ("data-csv-header-only", "d.csv", "prompt,label\n",
         "dataset '{t}/d.csv' is empty; it needs at least one row with a 'prompt' field"),
        ("data-arrow-damaged", "d.arrow", b"not arrow", None),
    ):
        case(name)(lambda t, file=file, content=content, line=line:
                   (on_data(write(t / file, content)), line and line.format(t=t)))

    @case("data-folder-of-two-types")
    def _(t):
        write(t / "d" / "a.jsonl", '{"prompt": "1+1=", "label": "2"}\n')
        write(t / "d" / "b.csv", "prompt,label\n1+2=,3\n")
        return on_data(t / "d"), \
            f"dataset folder '{t}/d' mixes file types (csv, json); keep one kind"

    def model_folder(t: Path, tiny: str, drop: tuple = (), config: str | None = None, extra: dict | None = None) -> Path:
        import shutil

        folder = t / "model"
        shutil.copytree(tiny, folder)
        for name in drop:
            for f in folder.glob(name):
                f.unlink()
        if config is not None:
            (folder / "config.json").write_text(config)
        for name, data in (extra or {}).items():
            write(folder / name, data)
        return folder

    @case("model-no-tokenizer")
    def _(t, tiny):
        f = model_folder(t, tiny, drop=("tokenizer*", "chat_template.jinja", "special_tokens_map.json"))
        return ["--model.path", str(f)], f"model.path '{f}' has no tokenizer (tokenizer.json / tokenizer_config.json); " \
            "save the tokenizer beside the model (tokenizer.save_pretrained)"

    @case("model-config-empty")
    def _(t, tiny):
        f = model_folder(t, tiny, config="")
        return ["--model.path", str(f)], f"model.path '{f}': config.json is empty; the folder is damaged (save the model again)"

    @case("model-config-garbage")
    def _(t, tiny):
        f = model_folder(t, tiny, config="{not json")
        return ["--model.path", str(f)], f"model.path '{f}': config.json is not valid JSON (Expecting property name " \
            "enclosed in double quotes: line 1 column 2 (char 1)); the folder is damaged"

    @case("model-no-model-type")
    def _(t, tiny):
        f = model_folder(t, tiny, config='{"hidden_size": 4}')
        return ["--model.path", str(f)], f"model.path '{f}': config.json names no model_type; it is not a transformers model folder"

    @case("model-custom-code")
    def _(t, tiny):
        config = json.loads((Path(tiny) / "config.json").read_text())
        config["auto_map"] = {"AutoModelForCausalLM": "modeling_mine.MyModel"}
        f = model_folder(t, tiny, config=json.dumps(config))
        return ["--model.path", str(f)], f"model.path '{f}' needs its own Python code to load (auto_map in config.json), " \
            "which is not run unless you trust it: pass --model.trust_remote_code true"

    @case("model-pickled-weights")
    def _(t, tiny):
        f = model_folder(t, tiny, drop=("*.safetensors",), extra={"pytorch_model.bin": b"\x80\x04pickled"})
        return ["--model.path", str(f)], f"model.path '{f}' holds pickled weights (pytorch_model.bin), which " \
            "rlhf-plugins does not load (unpickling can run code); convert them to safetensors " \
            "(model.save_pretrained(path, safe_serialization=True))"

    @case("model-no-weights")
    def _(t, tiny):
        f = model_folder(t, tiny, drop=("*.safetensors",))
        return ["--model.path", str(f)], f"model.path '{f}' has no weights (*.safetensors)"

    @case("model-corrupt-safetensors")
    def _(t, tiny):
        f = model_folder(t, tiny, extra={"model.safetensors": b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage"})
        return ["--model.path", str(f)], None

    @case("critic-missing")
    def _(t):
        return ["--critic.path", str(t / "nowhere")], \
            f"critic.path '{t}/nowhere' does not exist or is not a folder; give a local save_pretrained folder"

    @case("output-dir-is-a-file")
    def _(t):
        write(t / "file", "x")
        return ["--train.output_dir", str(t / "file"), "--train.run_name", "r"], \
            f"cannot create the run directory '{t}/file/r': Not a directory; choose another --train.output_dir"

    @case("output-dir-dev-null")
    def _(t):
        return ["--train.output_dir", "/dev/null", "--train.run_name", "r"], \
            "cannot create the run directory '/dev/null/r': Not a directory; choose another --train.output_dir"

    @case("output-dir-unwritable")
    def _(t):
        return ["--train.output_dir", "/proc/rlhf-runs", "--train.run_name", "r"], \
            "cannot create the run directory '/proc/rlhf-runs/r': No such file or directory; choose another " \
            "--train.output_dir"

    @case("run-exists")
    def _(t):
        (Path("runs") / "taken").mkdir(parents=True)
        return ["--train.run_name", "taken"], "run directory 'runs/taken' already exists; choose another " \
            "--train.run_name or continue it with --resume runs/taken"

    @case("trl-yaml-lr-word")
    def _(t):
        write(t / "grpo.yaml", "learning_rate: abc\n")
        return ["--trl-config", str(t / "grpo.yaml")], "TRL field 'learning_rate' expects float; got 'abc'"

    @case("trl-yaml-unknown-field")
    def _(t):
        write(t / "grpo.yaml", "num_generation: 4\n")
        return ["--trl-config", str(t / "grpo.yaml")], \
            "'num_generation' is not a field of trl.GRPOConfig; did you mean 'num_generations'?"

    @case("trl-yaml-training-field")
    def _(t):
        write(t / "grpo.yaml", "neftune_noise_alpha: 5.0\n")
        return ["--trl-config", str(t / "grpo.yaml")], "TRL field 'neftune_noise_alpha' (5.0) changes training and has " \
            "no equivalent in rlhf-plugins; remove it from the TRL config"

    @case("plugin-sys-exit-at-import")
    def _(t):
        write(t / "quits.py", "import sys\nsys.exit(3)\n")
        return ["--plugin", str(t / "quits.py")], \
            f"plugin '{t}/quits.py' called sys.exit(3) while importing; plugins must raise an error instead"

    @case("plugin-import-error")
    def _(t):
        write(t / "broken.py", "import no_such_module_zz\n")
        return ["--plugin", str(t / "broken.py")], \
            f"plugin '{t}/broken.py' failed to import: ModuleNotFoundError: No module named 'no_such_module_zz'"

    @case("plugin-a-folder")
    def _(t):
        return ["--plugin", str(t)], f"plugin '{t}' is a folder; give a .py file, or a package by its module name " \
            "(from the folder that holds it) or its entry point"

    @case("plugin-unknown")
    def _(t):
        return ["--plugin", "no_such_plugin_zz"], "unknown plugin 'no_such_plugin_zz': it is not an entry point of group " \
            "'rlhf_plugins', an importable module or a .py file; check the name or pip install the plugin"

    @case("plugin-no-hooks")
    def _(t):
        write(t / "empty.py", "x = 1\n")
        return ["--plugin", str(t / "empty.py")], \
            "plugin 'empty' defines no rlhf_* hooks, no reward function '(prompts, completions, **kwargs) -> list[float]' and no OpenRLHF AgentInstance"

    @case("reward-several-from-plugins")
    def _(t):
        write(t / "two.py", "def a(prompts, completions, **kw):\n    return [0.0] * len(completions)\n"
                             "def b(prompts, completions, **kw):\n    return [0.0] * len(completions)\n")
        return ["--plugin", str(t / "two.py")], \
            "plugins provide several reward functions (a, b); choose with --reward.functions NAME[,NAME]"

    @case("router-loss-on-a-dense-model")
    def _(t, tiny_model):
        return ["--model.path", tiny_model, "--learner.router_aux_loss_coef", "0.01"], \
            (f"learner.router_aux_loss_coef 0.01 weights a mixture of experts' load-balancing loss, and the model at "
             f"'{tiny_model}' has no routers that report it (no output_router_logits in its config); drop "
             "--learner.router_aux_loss_coef")

    @case("reference-path-unused")
    def _(t, tiny_model):
        return ["--model.reference_path", tiny_model, "--algo.kl.coef", "0"], \
            (f"model.reference_path '{tiny_model}' is the KL's reference model, and algo.kl.coef 0 runs without one; "
             "set --algo.kl.coef above 0 or drop --model.reference_path")

    @case("reference-path-small-vocabulary")
    def _(t):
        small = random_llama(t / "small", vocab_size=100)
        return ["--model.reference_path", small], \
            (f"model.reference_path '{small}' has a vocabulary of 100 tokens and the policy's tokenizer 366; the "
             "reference scores the policy's tokens, so it needs the policy's tokenizer: pick a reference of the "
             "policy's family")

    @case("reference-path-mixed-of-another-shape")
    def _(t):
        wider = random_llama(t / "wider", hidden_size=192)
        return ["--model.reference_path", wider, "--algo.kl.coef", "0.01", "--algo.kl.ref_sync_steps", "2"], \
            (f"algo.kl.ref_sync_steps mixes the policy's weights into the reference model, and model.reference_path "
             f"'{wider}' has another shape than the policy; drop one of them")

    return cases


FILES = _files()


@pytest.mark.parametrize("builder", [c[1] for c in FILES], ids=[c[0] for c in FILES])
def test_files_and_plugins(rlhf, tmp_path, tiny_model, builder):
    import inspect

    t = tmp_path / "in"
    t.mkdir()
    args, expected = builder(t, tiny_model) if len(inspect.signature(builder).parameters) == 2 else builder(t)
    code, _, err = rlhf("train", *args, *short_run())
    assert code == 2
    line = error_line(err)
    if expected is None:  # library wording inside: the start names the file
        assert line.startswith(("dataset", "model.path")) and str(t) in line, line
    else:
        assert line == expected
    assert not Path("runs").exists() or {p.name for p in Path("runs").iterdir()} <= {"taken"}


#: faults during the run: a plugin file each; the line, and whether a step completed first
RUNTIME = [
    ("reward-sys-exit", """
        import sys
        def quits(prompts, completions, **kwargs):
            sys.exit()
     """, [], "reward 'quits' (plugin 'p') at step 0 called sys.exit(None); a reward must return scores or raise"),
    ("reward-huge", """
        def big(prompts, completions, **kwargs):
            return [1e308] * len(completions)
     """, [], "reward 'big' (plugin 'p') at step 0 returned 1e+308 for sample 0; scores must be finite numbers within +-1e12"),
    ("reward-never-returns", """
        import time
        def slow(prompts, completions, **kwargs):
            time.sleep(60)
            return [0.0] * len(completions)
     """, ["--reward.timeout", "1"], "reward 'slow' (plugin 'p') at step 0 did not return within 1 s (--reward.timeout)"),
    ("reward-wrong-count", """
        def short(prompts, completions, **kwargs):
            return [0.0]
     """, [], "reward 'short' (plugin 'p') at step 0 returned 1 scores for 16 completions"),
    ("reward-wrong-count-in-evaluation", """
        def short(prompts, completions, **kwargs):
            return [0.0] * (len(completions) if len(completions) == 16 else 1)
     """, ["--eval.enabled", "true"],
     "reward 'short' (plugin 'p') in the evaluation after 0 steps returned 1 scores for 160 completions"),
    ("reward-wrong-type", """
        def words(prompts, completions, **kwargs):
            return ["good"] * len(completions)
     """, [], "reward 'words' (plugin 'p') at step 0 returned str 'good' for sample 0; expected a number"),
    ("load-hook-returns-str", """
        from rlhf_plugins import hookimpl
        @hookimpl(tryfirst=True)
        def rlhf_load_model(role, path, config):
            return "a model"
     """, [], "rlhf_load_model returned str for the generation model; it must return a "
         "torch.nn.Module (plugins implementing it, in call order: p, "),
    ("policy-loss-scalar", """
        from rlhf_plugins import hookimpl, PolicyLoss
        @hookimpl
        def rlhf_policy_losses():
            yield PolicyLoss("scalar", compute=lambda x, o: ((x.advantages * x.logprobs).mean(), {}))
     """, ["--algo.policy_loss.name", "scalar"], "policy loss 'scalar' returned (); it must "
         "return the per-token loss"),
    ("engine-without-logprobs-with-verify", """
        from rlhf_plugins import hookimpl, GenerationBackend
        from rlhf_plugins.engines.transformers_engine import TransformersEngine
        class NoProbe:
            def __init__(self, ctx):
                self.inner = TransformersEngine(ctx)
                self.generate, self.load_weights = self.inner.generate, self.inner.load_weights
                self.weight_shapes, self.shutdown = self.inner.weight_shapes, self.inner.shutdown
        @hookimpl
        def rlhf_generation_backends():
            yield GenerationBackend("noprobe", factory=NoProbe)
     """, ["--generation.backend", "noprobe", "--sync.verify", "true"],
     "generation backend 'noprobe' (plugin 'p') has no logprobs(), which --sync.verify needs (the engine/learner parity "
     "probe); turn --sync.verify off or use another engine"),
]


@pytest.mark.parametrize("source, extra, expected", [c[1:] for c in RUNTIME], ids=[c[0] for c in RUNTIME])
def test_faults_during_the_run(rlhf, tmp_path, source, extra, expected):
    plugin = write(tmp_path / "p.py", textwrap.dedent(source))
    code, _, err = rlhf("train", "--plugin", str(plugin), *short_run(), *extra)
    assert code == 2
    line = error_line(err)
    assert line.startswith(expected), line
    assert no_run_dirs()  # each failed before the first step completed


def test_an_observer_that_exits_after_a_step_keeps_the_run(rlhf, tmp_path):
    plugin = write(tmp_path / "q.py", "import sys\nfrom rlhf_plugins import hookimpl\n@hookimpl\n"
                                     "def rlhf_after_step(step, metrics):\n    sys.exit(0)\n")
    code, _, err = rlhf("train", "--plugin", str(plugin), *short_run("--train.run_name", "q"))
    assert code == 2
    assert error_line(err) == ("plugin 'q' called sys.exit(0) in rlhf_after_step; plugins must raise an error instead; "
                               f"the run is kept in {Path('runs/q')} (last complete step 1); after the fix, resume with: "
                               f"rlhf train --resume {Path('runs/q')}")


def test_cache_folder_problems(rlhf, tmp_path, monkeypatch):
    """Models built on first use (the reduced real-shape models, a source tree's tiny models) go to
    RLHF_CACHE_DIR; the default run needs no cache at all (its model ships with the package)."""
    from rlhf_plugins.errors import ConfigError
    from rlhf_plugins.models.tiny_model import cached_build

    monkeypatch.setenv("RLHF_CACHE_DIR", "/proc/rlhf-cache")
    code, _, err = rlhf("train", *short_run())
    assert code == 0, err
    with pytest.raises(ConfigError) as exc:
        cached_build("anything", lambda out: None)
    assert str(exc.value) == ("cannot create the cache folder '/proc/rlhf-cache' (No such file or directory); set "
                              "RLHF_CACHE_DIR to a writable folder")
    cached = write(tmp_path / "cache" / "tiny-llama-v1" / "config.json", "{oops")
    monkeypatch.setenv("RLHF_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ConfigError) as exc:
        cached_build("tiny-llama-v1", lambda out: None)
    line = str(exc.value)
    assert line.startswith("the cached model 'tiny-llama-v1' at ") and "config.json is not valid JSON" in line
    assert line.endswith(f"-- delete '{cached.parent}' and run again to rebuild it")


def test_vllm_context_shorter_than_prompt_and_budget(rlhf):
    pytest.importorskip("vllm")
    code, _, err = rlhf("train", "--generation.backend", "vllm", "--vllm.max_model_len", "4", *short_run())
    assert code == 2
    assert error_line(err).startswith("vllm.max_model_len (4) is shorter than the longest prompt (")
    assert no_run_dirs()


def test_an_address_where_something_else_listens(rlhf):
    server = HTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    server.RequestHandlerClass.log_message = lambda *a: None
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        code, _, err = rlhf("train", "--placement.strategy", "ray", "--ray.address", f"127.0.0.1:{port}",
                            "--ray.connect_timeout", "2", *short_run())
    finally:
        server.shutdown()
    assert code == 2
    assert error_line(err) == (f"'127.0.0.1:{port}' answers, but not as a Ray cluster (no gRPC within 2 s); check "
                               "--ray.address (a Ray head's GCS port, 6379 by default)")


def rule_messages(source: str) -> list[tuple[int, str]]:
    """(line, the longest literal part of its message) for every ``_require(...)`` and
    ``ConfigError(...)`` in ``source``."""
    import ast

    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("_require", "ConfigError"):
            msg = node.args[1] if node.func.id == "_require" else node.args[0]
            parts = [v.value for v in (msg.values if isinstance(msg, ast.JoinedStr) else [msg])
                     if isinstance(v, ast.Constant) and isinstance(v.value, str)]
            if parts:
                out.append((node.lineno, max(parts, key=len).strip()))
    return out


def test_every_rule_of_the_config_checks_has_a_catalogue_entry(tmp_path, tiny_model, monkeypatch):
    """Each rule config/checks.py enforces is run above (the catalogue asserts its whole line; a file
    case's line is the one its builder returns)."""
    import inspect

    from tests.helpers import ROOT

    monkeypatch.chdir(tmp_path)  # where the builders write, as under the rlhf fixture
    built = []
    for i, (_, builder) in enumerate(FILES):
        folder = tmp_path / str(i)
        folder.mkdir()
        two = len(inspect.signature(builder).parameters) == 2
        built.append(builder(folder, tiny_model)[1] if two else builder(folder)[1])
    lines = " ".join([*(str(entry[-1]) for group in (FLAGS, EVAL_FLAGS, RUNTIME) for entry in group),
                      *(str(line) for line in built)])
    rules = rule_messages((ROOT / "rlhf_plugins" / "config" / "checks.py").read_text())
    missing = [f"checks.py:{line}: {text}" for line, text in rules if text not in lines]
    assert len(rules) >= 12 and not missing, missing


def test_no_custom_code_prompt_ever_reaches_the_user(rlhf, tmp_path, tiny_model, monkeypatch):
    """transformers would ask 'run custom code? [y/N]'; with 'y' on stdin nothing may run."""
    import io

    config = json.loads((Path(tiny_model) / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "evil.EvilConfig"}
    import shutil

    folder = tmp_path / "evil-model"
    shutil.copytree(tiny_model, folder)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "evil.py").write_text("import pathlib\npathlib.Path('PWNED').write_text('x')\n")
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n"))
    code, out, err = rlhf("train", "--model.path", str(folder), *short_run())
    assert code == 2 and "needs its own Python code" in err and "[y/N]" not in out + err
    assert not Path("PWNED").exists() and not (folder / "PWNED").exists()
    assert os.environ.get("HF_HUB_OFFLINE") == "1"


@pytest.mark.parametrize("spelling", ["rewards.py", "rewards"])
def test_a_user_plugin_named_like_a_builtin_one_is_used(rlhf, spelling):
    """``rewards.py`` in the current directory shares the builtin reward plugin's name; it must not be skipped."""
    write(Path("rewards.py"), "def quarter(prompts, completions, **kwargs):\n    return [0.25] * len(completions)\n")
    code, _, err = rlhf("train", "--plugin", spelling, *short_run())
    assert code == 0, err
    rows = metrics_of(the_run())
    assert rows and all(row["reward/mean"] == 0.25 for row in rows)  # the builtin rewards never give 0.25 everywhere


def test_only_an_owner_and_name_that_is_not_here_reads_as_a_hub_id(tmp_path, monkeypatch):
    """The download hint is for `owner/name` (dots in the name, as Qwen2.5-0.5B's) that is not a path here; a data
    file's name, a deeper or explicitly relative path and an existing folder get the plain line."""
    from rlhf_plugins.errors import hub_download

    monkeypatch.chdir(tmp_path)
    (tmp_path / "local" / "model").mkdir(parents=True)
    assert hub_download("Qwen/Qwen2.5-0.5B") == ("if it names a Hugging Face Hub model, download it "
                                                 "(hf download Qwen/Qwen2.5-0.5B --local-dir DIR)")
    assert "--repo-type dataset trl-lib/tldr " in hub_download("trl-lib/tldr", "dataset")
    for path in ("data/train.jsonl", "a/b/c", "./a/b", "~/a", "local/model", "nowhere", "/abs", "a/"):
        assert hub_download(path) is None, path
