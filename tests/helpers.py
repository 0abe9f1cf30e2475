"""Helpers shared by the test modules (fixtures live in ``conftest.py``)."""
from __future__ import annotations

import functools
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def clean_env(extra: dict | None = None) -> dict:
    """This process's environment without the torch.distributed variables an in-process
    DeepSpeed run leaves set (a child would try to join that world)."""
    return {**{k: v for k, v in os.environ.items() if k not in DIST_ENV}, **(extra or {})}


def run_subprocess(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: int = 600,
                   fresh: bool = False) -> subprocess.CompletedProcess:
    """``python -m rlhf_plugins.cli ARGS`` as a process of its own, its output captured. Forked from a
    process that has imported torch and transformers already (:mod:`tests.warm_server`), unless
    ``fresh``: a new interpreter, for what only one shows (what imports print, packages installed
    during the tests; ``RLHF_TEST_FRESH_RUNS=1`` makes every run fresh). A fresh run's Ray workers are
    fresh interpreters too (not forked by :mod:`tests.ray_zygote`)."""
    if fresh or os.environ.get("RLHF_TEST_FRESH_RUNS") == "1" or not sys.platform.startswith("linux"):
        from tests.ray_zygote import SOCKET_ENV

        fresh_env = {k: v for k, v in clean_env(env).items() if k != SOCKET_ENV}  # its Ray workers fresh too
        return subprocess.run([sys.executable, "-m", "rlhf_plugins.cli", *args], cwd=cwd, env=fresh_env,
                              capture_output=True, text=True, timeout=timeout)
    return _WARM.run(list(args), Path(cwd or os.getcwd()), clean_env(env), timeout)


class _WarmCli:
    """The client of this test process's :mod:`tests.warm_server` (started on first use, ended with
    this process: its socket closes)."""

    def __init__(self) -> None:
        self.server: subprocess.Popen | None = None

    def _start(self) -> None:
        ours, theirs = socket.socketpair()
        self.log = Path(tempfile.mkdtemp(prefix="warm-cli-")) / "server.log"
        with self.log.open("w") as log:
            self.server = subprocess.Popen([sys.executable, "-m", "tests.warm_server", str(theirs.fileno())],
                                           cwd=ROOT, env=clean_env(), pass_fds=(theirs.fileno(),),
                                           stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        theirs.close()
        self.sock, self.stream = ours, ours.makefile("rwb", buffering=0)

    def _answer(self, timeout: float | None = None) -> int | None:
        if not select.select([self.sock], [], [], timeout)[0]:
            return None
        line = self.stream.readline()
        if not line:
            raise RuntimeError(f"the warm CLI server ended: {self.log.read_text()[-3000:]}")
        return int(line)

    def run(self, args: list[str], cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
        if self.server is None or self.server.poll() is not None:
            self._start()
        with tempfile.TemporaryDirectory(prefix="warm-run-") as tmp:
            out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
            request = {"args": args, "cwd": str(cwd), "env": env, "out": str(out), "err": str(err)}
            self.stream.write((json.dumps(request) + "\n").encode())
            pid = self._answer()
            code = self._answer(timeout)
            if code is None:
                os.kill(pid, signal.SIGKILL)
                self._answer()
                raise subprocess.TimeoutExpired(args, timeout, out.read_text(), err.read_text())
            return subprocess.CompletedProcess(args, code, out.read_text(errors="replace"),
                                               err.read_text(errors="replace"))


_WARM = _WarmCli()


def short_run(*extra: str) -> list[str]:
    """Flags for a quick training run on the default task, without held-out evaluation unless
    ``extra`` turns it on (``with_eval()``)."""
    return ["--train.steps", "3", "--train.prompts_per_step", "4", "--generation.n_samples_per_prompt", "4",
            "--train.progress", "false", "--eval.enabled", "false", *extra]


def with_eval(*extra: str) -> list[str]:
    """:func:`short_run` with the default held-out evaluation (before the first step, after the last)."""
    return short_run("--eval.enabled", "true", *extra)


def block_import(monkeypatch, module: str) -> None:
    """Make ``importlib.util.find_spec(module)`` report it missing (an uninstalled extra)."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a))


def needs_release_with(package: str, owner: Any, name: str) -> None:
    """Skip where the installed ``package`` has no ``name`` on ``owner`` (a module, or a dataclass's field): a
    feature of a later release than the floor setup.cfg declares (``scripts/compat_extras.sh`` runs there)."""
    import dataclasses

    import pytest

    names = {f.name for f in dataclasses.fields(owner)} if dataclasses.is_dataclass(owner) else set(dir(owner))
    if name not in names:
        pytest.skip(f"the installed {package} has no {name} (a later release's)")


def no_run_dirs(path: Path = Path("runs")) -> bool:
    return not path.exists() or not any(path.iterdir())


def check_one_line_error(code: int, err: str, expected: str) -> None:
    """The CLI refused bad input the project's way: exit status 2, one line ``rlhf: error: ...`` holding
    ``expected``, and no run directory left behind."""
    assert code == 2
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("rlhf: error: ")
    assert expected in lines[0], lines[0]
    assert no_run_dirs()


def the_run(base: Path = Path("runs")) -> Path:
    """The only run directory under ``base``."""
    dirs = list(base.iterdir())
    assert len(dirs) == 1, dirs
    return dirs[0]


def all_rows_of(run: Path) -> list[dict]:
    """Every row of a run's ``metrics.jsonl``: one per step, and one per held-out evaluation."""
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def metrics_of(run: Path) -> list[dict]:
    """The training rows of a run (one per step)."""
    from rlhf_plugins.training.runlog import is_eval_row

    return [r for r in all_rows_of(run) if not is_eval_row(r)]


def eval_rows_of(run: Path) -> list[dict]:
    """The held-out evaluation rows of a run, in order."""
    from rlhf_plugins.training.runlog import is_eval_row

    return [r for r in all_rows_of(run) if is_eval_row(r)]


def samples_of(run: Path) -> list[dict]:
    """The rows of a run's ``samples.jsonl`` (``--train.log_samples_every``): one per sample of a logged step."""
    return [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]


def eval_samples_of(run: Path) -> list[dict]:
    """The records of a run's ``eval_samples.jsonl`` (``--eval.log_samples``): one per held-out prompt of each
    evaluation."""
    return [json.loads(line) for line in (run / "eval_samples.jsonl").read_text().splitlines()]


def largest_allocation(fn: Any) -> int:
    """Bytes of the largest single CPU allocation while ``fn`` runs (torch's profiler also sees the
    buffers kernels allocate for themselves)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max((e.self_cpu_memory_usage for e in prof.events() if e.name != "[memory]"), default=0)


def random_rollout(group: int = 4, prompts: int = 3, seed: int = 0) -> Any:
    """A rollout of random token ids: ``prompts`` prompts with ``group`` random completions each, scored 0."""
    import torch

    from rlhf_plugins.training.rollout import Rollout

    g = torch.Generator().manual_seed(seed)
    prompt_ids, completion_ids = [], []
    for _ in range(prompts):
        prompt = torch.randint(10, 300, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
        for _ in range(group):
            prompt_ids.append(prompt)
            completion_ids.append(torch.randint(10, 300, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist())
    n = len(prompt_ids)
    return Rollout(prompts=[""] * n, prompt_ids=prompt_ids, completion_ids=completion_ids, completions=[""] * n,
                   finish_reasons=["stop"] * n, rollout_logprobs=[[0.0] * len(c) for c in completion_ids],
                   columns={}, group_size=group, scores=[0.0] * n)


def random_batch(group: int = 4, prompts: int = 3, seed: int = 0) -> dict[str, Any]:
    """The batch of :func:`random_rollout`."""
    from rlhf_plugins.training.rollout import make_batch

    return make_batch(random_rollout(group, prompts, seed), pad_id=0)


def make_reward_model(out: Path, kind: str = "trl", *, seed: int = 0, mean: float | None = None,
                      std: float | None = None, labels: int = 1) -> Path:
    """A reward model on the tiny Llama's backbone with a random one-output head, saved as TRL's
    ``RewardTrainer`` does (``kind="trl"``: LlamaForSequenceClassification) or as OpenRLHF does
    (``kind="openrlhf"``: the causal-LM config, backbone weights and a ``score`` head; with ``mean``
    and ``std`` its config asks for normalised scores)."""
    import json as _json

    import torch
    import transformers
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    from rlhf_plugins.testing import tiny_model_path

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

    src = tiny_model_path()
    torch.manual_seed(seed)
    cfg = LlamaConfig.from_pretrained(src, num_labels=labels)
    cfg.pad_token_id = AutoTokenizer.from_pretrained(src).pad_token_id
    model = LlamaForSequenceClassification.from_pretrained(src, config=cfg)
    with torch.no_grad():
        model.score.weight.normal_(0, 0.5)
    out.mkdir(parents=True, exist_ok=True)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    if kind == "trl":
        model.save_pretrained(out)
        return out
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"))
    config = _json.loads((Path(src) / "config.json").read_text())
    if mean is not None:
        config.update(normalize_reward=True, mean=mean, std=std)
    (out / "config.json").write_text(_json.dumps(config))
    return out


def start_local_ray() -> None:
    """A local Ray cluster with 8 CPUs and 4 fake GPUs, listening on 127.0.0.1 only."""
    from rlhf_plugins.placement.ray_cluster import loopback_only

    loopback_only()
    import ray

    os.environ["RAY_AUTH_MODE"] = "disabled"
    ray.init(address="local", _node_ip_address="127.0.0.1", num_cpus=8, num_gpus=4, include_dashboard=False, log_to_driver=False)


def assert_same_samples(got: Any, want: Any, atol: float) -> None:
    """Two engines' ``Samples`` agree: the same tokens and finish reasons, log-probs within ``atol``."""
    import torch

    assert got.completion_ids == want.completion_ids
    assert got.finish_reasons == want.finish_reasons
    for a, b in zip(got.logprobs, want.logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=atol)


def speedups_supported() -> bool:
    """Whether this transformers runs the package's own KV caches and attention (else its own:
    transformers 4.x, see ``rlhf_plugins.models.speedups``); tests of that machinery need them."""
    from rlhf_plugins.models import speedups

    return speedups.supported()


#: a plugin that SIGKILLs its own process where KILL_AT says (step N after the step, or ckpt N
#: inside the checkpoint write of step N); without KILL_AT it does nothing, so a resume runs clean
KILLER = textwrap.dedent("""
    import os, signal
    from rlhf_plugins import hookimpl
    WHERE = os.environ.get("KILL_AT", "")
    STEPS = [0]

    @hookimpl
    def rlhf_after_step(step, metrics):
        STEPS[0] = step + 1
        if WHERE == f"step {step}":
            os.kill(os.getpid(), signal.SIGKILL)

    @hookimpl
    def rlhf_state_dict():
        if WHERE == f"ckpt {STEPS[0]}":
            os.kill(os.getpid(), signal.SIGKILL)
        return {"steps_seen": STEPS[0]}

    @hookimpl
    def rlhf_load_state_dict(state):
        STEPS[0] = state["steps_seen"]
""")


def prompts(model_path: str) -> list[list[int]]:
    """Four chat-templated addition prompts in the model's tokenizer (engine tests)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    return [tok.apply_chat_template([{"role": "user", "content": f"{a}+{a}="}], add_generation_prompt=True)["input_ids"]
            for a in range(4)]


def draws_of_a_seeded_engine(engine: Any) -> dict[str, Any]:
    """What an engine of the tiny model samples for one prompt in the ways the loop calls it: the prompt
    six times in one call (a group's later turns, equal prompts of a rollout), one request of three
    samples under two adjacent seeds (the loop's steps, rounds, parts and turns differ by a little), and
    the first call again. The prompt is twelve token ids of no task, at temperature 2: the tiny model
    answers its addition prompts in a token or two, but runs on here, so a draw repeats only when its
    random stream does."""
    import torch

    from rlhf_plugins import SamplingParams

    prompt = torch.randint(10, 300, (12,), generator=torch.Generator().manual_seed(0)).tolist()

    def draw(prompts: list[list[int]], n: int, seed: int) -> list[tuple[int, ...]]:
        params = SamplingParams(n=n, max_new_tokens=8, temperature=2.0, seed=seed)
        return [tuple(c) for c in engine.generate(prompts, params).completion_ids]

    return {"repeated": draw([prompt] * 6, 1, 5), "seed5": draw([prompt], 3, 5), "seed6": draw([prompt], 3, 6),
            "again": draw([prompt] * 6, 1, 5)}


class Actor:
    """A learner stand-in for parity checks: a transformers model and its log-probs."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def logprobs(self, batch: dict) -> Any:
        import torch

        from rlhf_plugins.models.forward import policy_forward

        with torch.no_grad():
            return policy_forward(self.model, batch)["logprobs"]


def batch_of(ids: list[list[int]], samples: Any, n: int) -> dict:
    """The training batch of an engine's samples (``n`` per prompt of ``ids``)."""
    from rlhf_plugins.training.rollout import Rollout, make_batch

    r = Rollout(prompts=[""] * len(samples), prompt_ids=[ids[i // n] for i in range(len(samples))],
                completion_ids=samples.completion_ids, completions=[""] * len(samples),
                finish_reasons=samples.finish_reasons, rollout_logprobs=samples.logprobs, columns={},
                group_size=n, scores=[0.0] * len(samples))
    return make_batch(r, pad_id=0)


def torch_learner(dtype: str = "bfloat16", fp32_lm_head: bool = False, **learner_cfg: Any) -> Any:
    """The torch learner of the actor role on the default model, for batches of 3 prompts x 4 samples
    in micro batches of 6 (``learner_cfg``: more ``learner.*`` settings; ``fp32_lm_head``: the model's)."""
    from rlhf_plugins.api import prepare
    from rlhf_plugins.learners.torch_learner import TorchLearner
    from rlhf_plugins.models.tiny_model import default_model_path
    from rlhf_plugins.testing import backend_context

    raw = {"model": {"dtype": "bfloat16", "fp32_lm_head": fp32_lm_head}, "learner": {"lr": 1e-3, "micro_batch_size": 6, **learner_cfg},
           "train": {"prompts_per_step": 3}, "generation": {"n_samples_per_prompt": 4}}
    config, pm, _ = prepare(raw, autoload=False)
    config.model.dtype = dtype  # float16 is refused on a CPU for whole runs; one update is fine
    return TorchLearner(backend_context(config, "actor", default_model_path(), pm))


def bucketed_and_per_parameter_learners(monkeypatch: Any, bucket_bytes: int = 2**17) -> tuple[Any, Any]:
    """Two bf16 :func:`torch_learner` s with float32 masters: one moving its 16-bit gradients onto the
    masters in buckets of ``bucket_bytes`` (several for the default model), one moving each alone."""
    from rlhf_plugins.learners import master_weights

    monkeypatch.setattr(master_weights, "BUCKET_BYTES", bucket_bytes)
    bucketed = torch_learner()
    monkeypatch.setattr(master_weights, "BUCKET_BYTES", 0)
    return bucketed, torch_learner()


def ppo_batch(seed: int = 5) -> dict[str, Any]:
    """:func:`random_batch` (3 prompts x 4 samples) with random advantages on its completion tokens."""
    import torch

    batch = random_batch(group=4, prompts=3, seed=seed)
    g = torch.Generator().manual_seed(seed)
    batch["advantages"] = torch.randn(batch["action_mask"].shape, generator=g) * batch["action_mask"]
    return batch


def ppo_update(learner: Any, batch: dict[str, Any]) -> dict[str, float]:
    """One ``learner.train`` call on ``batch`` with the PPO-clip objective at the default settings."""
    from rlhf_plugins.algorithms import policy_losses
    from rlhf_plugins.algorithms.objective import Objective
    from rlhf_plugins.api import prepare

    return learner.train(batch, Objective(policy_losses.ppo, prepare({}, autoload=False)[0].algo.policy_loss))


#: ``learner.logits_memory_mb`` of 4 tokens of the default model's 366-entry vocabulary per chunk (its
#: head then runs chunk by chunk, as a real vocabulary's does); the default budget holds its whole logits
TINY_CHUNKS, WHOLE_LOGITS = 0.02, 256.0


def compiled_learner_gaps(dtype: str, compile_scope: str = "blocks", compile_mode: str = "default",
                          **learner_cfg: Any) -> dict[str, dict[str, float]]:
    """``--learner.compile`` against eager torch: a compiled and an eager learner in ``dtype`` and an
    eager float32 one make two SGD updates (old log-probs without gradient first) on batches of other
    shapes. Returns, for the compiled and the eager ``dtype`` learner, the largest distance from the
    float32 learner of the old log-probs, of the gradient norm (relative) and of the optimizer's
    weights (the float32 masters of a 16-bit run); ``compile_scope``, ``compile_mode``: the compiled learner's;
    ``learner_cfg``: more ``learner.*`` settings of all three. Also checks that what ran was compiled
    (dynamo made graphs)."""
    import torch
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # compiled afresh, whatever ran before: the check below sees this compilation
    ref, compiled, eager = (torch_learner(d, lr=0.5, optimizer="sgd", compile=c, **learner_cfg,
                                          **({"compile_scope": compile_scope, "compile_mode": compile_mode} if c else {}))
                            for d, c in (("float32", False), (dtype, True), (dtype, False)))
    counters.clear()
    gaps = update_gaps(ref, {"compiled": compiled, "eager": eager})
    assert counters["stats"]["unique_graphs"] >= 2
    return gaps


def update_gaps(ref: Any, sides: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Learners made by :func:`torch_learner` with SGD (the weights' change is then the gradient itself;
    Adam's first step is about lr * sign(gradient), which flips wherever a gradient is rounding noise)
    make two updates, old log-probs without gradient first, on batches of other shapes. Returns, for
    each of ``sides``, the largest distance from ``ref`` of the old log-probs, of the gradient norm
    (relative) and of the optimizer's weights (the float32 masters of a 16-bit run)."""
    def weights(learner: Any) -> list[Any]:
        return [p for group in learner.optimizer.param_groups for p in group["params"]]

    gaps = {name: {"logprobs": 0.0, "grad_norm": 0.0, "weights": 0.0} for name in sides}
    for seed in (3, 4):
        batch = ppo_batch(seed)
        mask = batch["action_mask"].bool()
        want_old = ref.logprobs(batch)
        olds = {name: side.logprobs(batch) for name, side in sides.items()}
        batch["old_logprobs"] = want_old
        want = ppo_update(ref, batch)["grad_norm"]
        for name, side in sides.items():
            g = gaps[name]
            g["logprobs"] = max(g["logprobs"], float((olds[name] - want_old).abs()[mask].max()))
            g["grad_norm"] = max(g["grad_norm"], abs(ppo_update(side, batch)["grad_norm"] - want) / want)
            g["weights"] = max(g["weights"], max(float((a - b).detach().abs().max()) for a, b in zip(weights(side), weights(ref))))
    return gaps


def cuda_graph_gaps(dtype: str) -> dict[str, float]:
    """Whole compiled decoder layers with CUDA graphs (``--learner.compile_mode reduce-overhead``)
    against the same compiled layers without (``default``), in ``dtype``, over :func:`update_gaps`'s
    two updates of two micro batches each: the largest distance between the two of the old log-probs,
    of the gradient norm (relative) and of the optimizer's weights."""
    import torch

    torch._dynamo.reset()
    plain, graphed = (torch_learner(dtype, lr=0.5, optimizer="sgd", compile=True, compile_scope="layers",
                                    compile_mode=mode) for mode in ("default", "reduce-overhead"))
    return update_gaps(plain, {"graphed": graphed})["graphed"]


def random_llama(out: Path, **sizes: Any) -> str:
    """A random Llama of the given sizes (else the tiny model's), the tiny model's tokenizer beside it."""
    import contextlib
    import io

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from rlhf_plugins.models.folder import save_pretrained, save_tokenizer
    from rlhf_plugins.testing import tiny_model_path

    config = AutoConfig.from_pretrained(tiny_model_path())
    for key, value in sizes.items():
        setattr(config, key, value)
    with contextlib.redirect_stderr(io.StringIO()):  # the writer's progress bar: not the CLI's stderr under test
        save_pretrained(AutoModelForCausalLM.from_config(config), out)
    save_tokenizer(AutoTokenizer.from_pretrained(tiny_model_path()), out)
    return str(out)


def gpt2_model_path() -> str:
    """A cached random GPT-2 (transformers' Conv1D layers, weights stored in x out; learned positions), 64 wide
    and two layers, the tiny model's tokenizer beside it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from rlhf_plugins.models.folder import save_pretrained, save_tokenizer
    from rlhf_plugins.models.tiny_model import cached_build, default_model_path

    def build(out: Path) -> None:
        tokenizer = AutoTokenizer.from_pretrained(default_model_path(quiet=True))
        config = AutoConfig.for_model("gpt2", vocab_size=512, n_embd=64, n_layer=2, n_head=2, n_positions=256,
                                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                      pad_token_id=tokenizer.pad_token_id)
        torch.manual_seed(0)
        save_pretrained(AutoModelForCausalLM.from_config(config), out)
        save_tokenizer(tokenizer, out)

    return cached_build("gpt2-2x64-v1", build, quiet=True)


def hybrid_model_path() -> str:
    """A cached random Granite-4.0-H-like model (transformers' ``granitemoehybrid``): a Mamba-2 layer,
    then an attention layer, experts in each; 128 wide, weights drawn ten times wider than transformers'
    default (a state that leaks from one sample into another shows in the log-probs); the embedded
    tokenizer beside it."""
    from rlhf_plugins.models.tiny_model import cached_build

    def build(out: Path) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        from rlhf_plugins.models.folder import save_pretrained, save_tokenizer
        from rlhf_plugins.testing import tiny_model_path

        tokenizer = AutoTokenizer.from_pretrained(tiny_model_path())
        config = AutoConfig.for_model(
            "granitemoehybrid", vocab_size=512, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
            layer_types=["linear_attention", "full_attention"], num_attention_heads=4, num_key_value_heads=2,
            num_local_experts=4, num_experts_per_tok=2, mamba_n_heads=8, mamba_d_head=32, mamba_d_state=16,
            mamba_n_groups=1, shared_intermediate_size=128, tie_word_embeddings=True, initializer_range=0.2,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        save_pretrained(model, out)
        save_tokenizer(tokenizer, out)

    return cached_build("granite-hybrid-2x128-v2", build, quiet=True)


def sampling_logprobs(model: Any, prompt: list[int], completion: list[int], temperature: float,
                      repetition_penalty: float = 1.0) -> tuple[Any, Any]:
    """By hand, for one sample: each completion token's log-prob under the tempered distribution
    with the repetition penalty applied (a token of the prompt or of the completion before it: logit
    divided by the penalty when positive, multiplied when negative), and that whole distribution's
    probabilities per position ``[T, V]``."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1].double()
    rows = []
    for t in range(len(completion)):
        row = logits[t].clone()
        seen = torch.tensor(sorted(set(prompt) | set(completion[:t])))
        row[seen] = torch.where(row[seen] > 0, row[seen] / repetition_penalty, row[seen] * repetition_penalty)
        rows.append(torch.log_softmax(row / temperature, -1))
    table = torch.stack(rows)
    return table.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1), table.exp()


def stopped_by_strings(tokenizer: Any, samples: Any, stop: tuple[str, ...]) -> int:
    """Checks vLLM's stop-string rule on ``samples``: no completion's text holds a stop string before its
    last token; one whose whole text holds one finished with "stop". Returns how many a stop string ended
    (texts decoded without special tokens, as vLLM matches them)."""
    ended = 0
    for completion, reason in zip(samples.completion_ids, samples.finish_reasons):
        before = tokenizer.decode(completion[:-1], skip_special_tokens=True)
        assert not any(s in before for s in stop), (before, completion)
        if any(s in tokenizer.decode(completion, skip_special_tokens=True) for s in stop):
            assert reason == "stop", completion
            ended += 1
    return ended


def rollout_spy(folder: Path) -> tuple[Path, Any]:
    """A plugin file that records every step's rollout prompts and prompt ids, and a function that
    reads them back: ``[(prompts, prompt_ids), ...]``, one per step."""
    import json
    import textwrap

    seen, plugin = folder / "seen_rollouts.jsonl", folder / "rollout_spy.py"
    plugin.write_text(textwrap.dedent(f"""
        import json
        from rlhf_plugins import hookimpl
        @hookimpl
        def rlhf_after_rollout(step, rollout):
            open({str(seen)!r}, "a").write(json.dumps([rollout.prompts, rollout.prompt_ids]) + "\\n")
    """))
    return plugin, lambda: [tuple(json.loads(line)) for line in seen.read_text().splitlines()]


def in_process_trainer(model_path: str, raw: dict) -> Any:
    """A set-up ``Trainer`` of the raw config on the model at ``model_path``, in this process (its
    steps called one by one; ``shutdown()`` when done)."""
    from transformers import AutoTokenizer

    from rlhf_plugins.api import prepare
    from rlhf_plugins.data.prompts import load_prompts
    from rlhf_plugins.training.loop import Trainer

    config, pm, plan = prepare(raw, autoload=False)
    tok = AutoTokenizer.from_pretrained(model_path)
    t = Trainer(config, pm, plan, load_prompts(config.data, tok), tok, model_path)
    t.setup()
    return t


#: model_type and the public config's fields (google/gemma-2-2b, google/gemma-3-1b-pt,
#: microsoft/Phi-3-mini-4k-instruct, mistralai/Mistral-7B-v0.3, ibm-granite/granite-3.1-2b-base,
#: HuggingFaceTB/SmolLM3-3B, ByteDance-Seed/Seed-OSS-36B-Base, zai-org/GLM-4-9B-0414,
#: deepseek-ai/DeepSeek-V3) that shape the computation, at 64 wide;
#: sliding windows of 8 tokens, so that they slide within these short samples
ARCHITECTURES = {
    "gemma2": ("gemma2", dict(vocab_size=256000, head_dim=32, query_pre_attn_scalar=32, sliding_window=8,
                              attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                              hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)),
    "gemma3": ("gemma3_text", dict(vocab_size=262144, head_dim=32, query_pre_attn_scalar=32, sliding_window=8,
                                   layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=True)),
    "phi3": ("phi3", dict(vocab_size=32064, tie_word_embeddings=False, sliding_window=None)),
    "mistral": ("mistral", dict(vocab_size=32768, head_dim=32, sliding_window=None, rope_theta=1000000.0,
                                tie_word_embeddings=False)),
    "granite": ("granite", dict(vocab_size=49155, embedding_multiplier=12.0, residual_multiplier=0.22,
                                attention_multiplier=0.015625, logits_scaling=8.0, tie_word_embeddings=True)),
    "smollm3": ("smollm3", dict(vocab_size=128256, no_rope_layer_interval=2, tie_word_embeddings=True)),
    "glm4": ("glm4", dict(vocab_size=151552, head_dim=32, partial_rotary_factor=0.5, attention_bias=True,
                          tie_word_embeddings=False)),
    # multi-head latent attention (low-rank queries and keys, RoPE on a slice), a dense first layer, then 8
    # routed experts (2 per token, grouped sigmoid routing) beside a shared one
    "deepseek_v3": ("deepseek_v3", dict(vocab_size=129280, moe_intermediate_size=32, n_routed_experts=8,
                                        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                                        q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
                                        v_head_dim=16, n_group=2, topk_group=1, num_key_value_heads=2,
                                        tie_word_embeddings=False)),
    # its config keeps dropout (0.1 in attention and on the residuals): --learner.disable_dropout's case
    "seed_oss": ("seed_oss", dict(vocab_size=155136, head_dim=32, attention_bias=True, attention_dropout=0.1,
                                  residual_dropout=0.1, rope_theta=10000000.0, tie_word_embeddings=False)),
}

#: the weights that make queries and keys (DeepSeek's latent attention: its up-projections)
QUERIES_AND_KEYS = ("q_proj.weight", "k_proj.weight", "qkv_proj.weight", "q_b_proj.weight", "kv_b_proj.weight")


def family_model_path(name: str) -> str:
    """A cached random-weight model of the public config ``ARCHITECTURES[name]`` reduced to 64 wide and two
    layers (its vocabulary and distinctive fields kept), queries and keys at a trained model's spread."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from rlhf_plugins.models.folder import save_pretrained, save_tokenizer
    from rlhf_plugins.models.tiny_model import cached_build, default_model_path

    def build(out: Path) -> None:
        model_type, fields = ARCHITECTURES[name]
        tokenizer = AutoTokenizer.from_pretrained(default_model_path(quiet=True))
        sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=1)
        config = AutoConfig.for_model(model_type, **{**sizes, **fields}, bos_token_id=tokenizer.bos_token_id,
                                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():  # queries and keys of a trained model's spread: attention far from uniform,
            for key, weight in model.named_parameters():  # so its scale and masks decide what samples read
                if key.endswith(QUERIES_AND_KEYS):
                    weight.normal_(0, 0.3)
        save_pretrained(model, out)
        save_tokenizer(tokenizer, out)

    return cached_build(f"architecture-{name}-v4", build, quiet=True)


def before_each_optimizer_step(optimizer: Any, before: Any) -> None:
    """Calls ``before()`` each time ``optimizer`` steps, just before the step (to record gradients); the step
    keeps the mark a learning-rate scheduler put on it, so the scheduler does not warn that it was replaced."""
    step = optimizer.step

    @functools.wraps(step)
    def recording(*args: Any, **kwargs: Any) -> Any:
        before()
        return step(*args, **kwargs)

    optimizer.step = recording


def raise_cpp_compile_error(output: str) -> None:
    """Raise what a torch.compile raises when g++ fails on a kernel: inductor's C++ compile error with
    the compiler's ``output``, from the compiler's exit status."""
    from torch._inductor.exc import CppCompileError

    try:
        raise subprocess.CalledProcessError(1, ["g++", "-O3", "k.cpp"])
    except subprocess.CalledProcessError as called:
        raise CppCompileError(["g++", "-O3", "k.cpp"], output) from called
