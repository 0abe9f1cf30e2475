"""Remote rewards over OpenRLHF's protocol, against `rlhf serve-reward` (FastAPI + uvicorn) and a
faulty server of our own, all on 127.0.0.1: batching, retries with backoff, and one clear line for
every way a server can fail (refused, killed mid-run, slow, HTTP 500, not JSON, wrong count)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from rlhf_plugins.errors import RewardError
from rlhf_plugins.rewards.remote import RemoteReward
from tests.helpers import clean_env, make_reward_model, metrics_of, run_subprocess, short_run

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(*args: str, cwd=None, tries: int = 3) -> tuple[subprocess.Popen, str]:
    """A reward server on a free loopback port; another process may take the port while the server starts
    (seconds of imports): then again on another port."""
    for attempt in range(tries):
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "rlhf_plugins.cli", "serve-reward", *args, "--host",
                                 "127.0.0.1", "--port", str(port)], cwd=cwd,
                                env=clean_env({"RLHF_DISABLE_PLUGIN_AUTOLOAD": "1"}),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    return proc, f"{url}/get_reward"
            except httpx.TransportError:
                time.sleep(0.2)
            if proc.poll() is not None:
                err = proc.stderr.read()
                if "address already in use" in err and attempt + 1 < tries:
                    break
                raise AssertionError(err)
        else:
            proc.kill()
            raise AssertionError("reward server did not start")
    raise AssertionError("no free port for the reward server")


@pytest.fixture(scope="module")
def exact_match_server():
    proc, url = serve("--function", "exact_match", "--max-wait-ms", "200", "--batch-size", "64")
    yield url
    proc.terminate()
    proc.wait(timeout=30)


def test_the_server_scores_with_the_function_and_batches_concurrent_requests(exact_match_server):
    client = RemoteReward([exact_match_server], batch_size=2, concurrency=4)
    prompts = ["<u>3+4=<a>", "<u>1+1=<a>", "<u>2+2=<a>", "<u>5+5=<a>", "<u>0+1=<a>", "<u>9+0=<a>", "<u>1+2=<a>",
               "<u>4+4=<a>"]
    completions = ["7", "3", "4", "10", "1", "8", "3", "8<eos>"]
    labels = ["7", "2", "4", "10", "1", "9", "3", "8"]
    stats = exact_match_server.replace("/get_reward", "/stats")
    before = httpx.get(stats).json()["batches"]
    got = client(prompts, completions, queries=[p + c for p, c in zip(prompts, completions)], prompt_texts=prompts,
                 label=labels)
    assert got == [1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0]
    # four requests of two sent at once were scored in fewer model calls than requests
    assert httpx.get(stats).json()["batches"] - before < 4
    answer = httpx.post(exact_match_server, json={"query": ["x"], "prompts": ["x"], "labels": [1]}).json()
    assert answer["extra_logs"] == {}  # OpenRLHF's client would log anything here as the user's metrics
    assert set(answer) == {"rewards", "scores", "extra_logs"}


def test_the_server_answers_an_openrlhf_reward_files_rewards_and_scores(tmp_path):
    """`rlhf serve-reward --plugin reward_func.py --function reward_func`: OpenRLHF's function gets the
    request's queries, prompts and labels as they came, and its rewards and scores are the answer."""
    (tmp_path / "reward_func.py").write_text(textwrap.dedent("""
        import torch
        def reward_func(queries, prompts, labels):
            rewards = torch.tensor([float(len(q)) for q in queries])
            scores = torch.tensor([float(l) if q.startswith(p) else 0.0 for q, p, l in zip(queries, prompts, labels)])
            return {"rewards": rewards, "scores": scores, "extra_logs": {"n": rewards}}
    """))
    proc, url = serve("--plugin", "reward_func.py", "--function", "reward_func", cwd=tmp_path)
    try:
        answer = httpx.post(url, json={"query": ["<u>ab", "xyz!"], "prompts": ["<u>", "q"], "labels": [3, 2]},
                            timeout=30).json()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert answer == {"rewards": [5.0, 4.0], "scores": [3.0, 0.0], "extra_logs": {}}


def test_training_with_a_remote_reward_scores_like_the_same_reward_in_process(exact_match_server, rlhf):
    code, _, err = rlhf("train", "--reward.functions", "exact_match", *short_run("--train.run_name", "local"))
    assert code == 0, err
    code, _, err = rlhf("train", "--reward.remote_urls", exact_match_server, "--reward.remote_batch_size", "5",
                        *short_run("--train.run_name", "remote"))
    assert code == 0, err
    from pathlib import Path

    local, remote = metrics_of(Path("runs/local")), metrics_of(Path("runs/remote"))
    # the same first rollout gets the same rewards; later the server sees special tokens the local
    # function does not (OpenRLHF's protocol sends the decoded text as the policy saw it)
    assert remote[0]["reward/mean"] == local[0]["reward/mean"]
    assert len(remote) == 3 and all(0.0 <= r["reward/mean"] <= 1.0 for r in remote)


class Faulty(BaseHTTPRequestHandler):
    """Answers by ``server.mode``: 500, 500-once, notjson, count, slow, extra (OpenRLHF's extra_logs),
    scores (OpenRLHF's ``scores`` beside the rewards: 1 for an odd-length query, else 0)."""

    def log_message(self, *args):  # quiet
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = len(body["query"])
        server = self.server
        server.calls, server.last = server.calls + 1, body
        mode = server.mode
        if mode == "500" or (mode == "500-once" and server.calls == 1):
            return self._send(500, b"model crashed: CUDA out of memory")
        if mode == "notjson":
            return self._send(200, b"<html>gateway</html>")
        if mode == "count":
            return self._send(200, json.dumps({"rewards": [0.0] * (n + 1)}).encode())
        if mode == "slow":
            time.sleep(3)
        if mode == "extra":  # per-sample values and a scalar, as OpenRLHF's servers send them
            extra = {"format_ok": [float(len(q) % 2) for q in body["query"]], "server_batch": float(n)}
            return self._send(200, json.dumps({"rewards": [0.5] * n, "extra_logs": extra}).encode())
        if mode == "scores":
            scores = [float(len(q) % 2) for q in body["query"]]
            return self._send(200, json.dumps({"rewards": [s - 0.25 for s in scores], "scores": scores}).encode())
        return self._send(200, json.dumps({"rewards": [0.5] * n}).encode())

    def _send(self, code, body):
        try:
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client timed out first ("slow"): nothing to answer, and nothing for a later test's stderr


@pytest.fixture
def faulty():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Faulty)
    server.calls, server.mode = 0, "ok"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server, f"http://127.0.0.1:{server.server_address[1]}/get_reward"
    server.shutdown()
    server.server_close()


@pytest.mark.timeout(120)  # a hang fails here instead of stalling the suite
@pytest.mark.parametrize("mode, expected", [
    ("500", "failed 3 times; last: HTTP 500 (model crashed: CUDA out of memory)"),
    ("notjson", "answered something that is not JSON: '<html>gateway</html>'"),
    ("count", "returned 3 rewards for 2 queries"),
    ("slow", "failed 3 times; last: ReadTimeout"),
])
def test_every_server_fault_is_one_line_naming_the_url(faulty, mode, expected):
    server, url = faulty
    server.mode = mode
    client = RemoteReward([url], timeout=1.0, attempts=3, backoff=0.05)
    with pytest.raises(RewardError) as info:
        client(["a", "b"], ["1", "2"])
    assert str(info.value).startswith(f"reward server {url} ") and expected in str(info.value)


def test_a_transient_500_is_retried(faulty):
    server, url = faulty
    server.mode = "500-once"
    assert RemoteReward([url], backoff=0.01)(["a", "b"], ["1", "2"]) == [0.5, 0.5]
    assert server.calls == 2


def test_a_servers_extra_logs_become_metrics_of_the_step(faulty):
    from rlhf_plugins.api import prepare
    from rlhf_plugins.training.reward_role import RewardBatch, RewardRole

    server, url = faulty
    server.mode = "extra"
    cfg, pm, plan = prepare({"reward": {"remote_urls": [url], "remote_batch_size": 2}}, autoload=False)
    role = RewardRole(cfg, pm.spec, plan.rewards, plan.weights)
    queries = ["1+1=2", "1+1=22", "2+2=4", "2+2=44"]  # odd, even, odd, even lengths
    batch = RewardBatch(["1+1="] * 2 + ["2+2="] * 2, ["2", "22", "4", "44"], [[1]] * 4, {}, 1, queries,
                        ["1+1="] * 2 + ["2+2="] * 2)
    result = role.score(batch)
    assert result.scores == [0.5] * 4 and server.calls == 2
    assert result.logged == {"format_ok": [0.5, 0.5], "server_batch": [2.0, 2.0]}  # each request's means


def test_a_servers_scores_are_what_dynamic_filtering_compares_and_its_rewards_train(faulty):
    """OpenRLHF's servers answer ``rewards`` (the advantage's input) and ``scores`` (what its dynamic
    filtering compares); with a second source of weight 2, the filter compares the weighted sum with the
    server's scores in place of its rewards."""
    from rlhf_plugins.api import prepare
    from rlhf_plugins.training.reward_role import RewardBatch, RewardRole

    server, url = faulty
    server.mode = "scores"
    cfg, pm, plan = prepare({"reward": {"remote_urls": [url], "remote_batch_size": 3, "functions": ["exact_match"],
                                        "weights": [2.0, 1.0]}}, autoload=False)
    role = RewardRole(cfg, pm.spec, plan.rewards, plan.weights)
    queries = ["1+1=2", "1+1=22", "2+2=4", "2+2=44"]  # odd, even, odd, even lengths
    batch = RewardBatch(["1+1="] * 2 + ["2+2="] * 2, ["2", "22", "4", "44"], [[1]] * 4, {"label": [2, 2, 4, 4]}, 1,
                        queries, ["1+1="] * 2 + ["2+2="] * 2)
    result = role.score(batch)
    assert result.parts == {"exact_match": [1.0, 0.0, 1.0, 0.0], "remote": [0.75, -0.25, 0.75, -0.25]}
    assert result.scores == [2.75, -0.25, 2.75, -0.25]  # 2 x exact_match + the server's rewards
    assert result.filter_scores == [3.0, 0.0, 3.0, 0.0]  # 2 x exact_match + the server's scores
    assert server.calls == 2


def test_a_client_returns_a_servers_scores_and_refuses_scores_not_one_per_query(faulty):
    server, url = faulty
    server.mode = "scores"
    client = RemoteReward([url])
    assert client(["ab", "abc"], ["", ""]) == {"rewards": [-0.25, 0.75], "scores": [0.0, 1.0]}
    assert server.last["labels"] == ["", ""]  # no label column: OpenRLHF's empty labels, not None
    with pytest.raises(RewardError) as info:
        RemoteReward._rewards(url, httpx.Response(200, json={"rewards": [1.0], "scores": []}), 1)
    assert str(info.value) == f"reward server {url} answered 'scores' that are not a list of 1 numbers: '[]'"


def test_requests_are_spread_over_several_urls(faulty):
    server, url = faulty
    other = ThreadingHTTPServer(("127.0.0.1", 0), Faulty)
    other.calls, other.mode = 0, "ok"
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        client = RemoteReward([url, f"http://127.0.0.1:{other.server_address[1]}/get_reward"], batch_size=1)
        assert client(list("abcd"), list("1234")) == [0.5] * 4
        assert (server.calls, other.calls) == (2, 2)
    finally:
        other.shutdown()


def test_a_refused_connection_is_one_line_and_exit_2(rlhf):
    closed = f"http://127.0.0.1:{free_port()}/get_reward"
    code, _, err = rlhf("train", "--reward.remote_urls", closed, "--reward.remote_retries", "2", *short_run())
    assert code == 2
    *warnings, line = err.strip().splitlines()
    assert line.startswith("rlhf: error: ") and f"reward server {closed} failed 2 times; last: ConnectError" in line
    assert all("retrying" in w for w in warnings) and len(warnings) <= 2, err  # the retry said as it happened


def test_a_server_killed_mid_run_stops_the_run_with_the_url_and_keeps_it(tmp_path, tiny_model):
    proc, url = serve("--function", "exact_match")
    (tmp_path / "kill.py").write_text(textwrap.dedent(f"""
        import os, signal
        from rlhf_plugins import hookimpl
        @hookimpl
        def rlhf_after_step(step, metrics):
            if step == 1:
                os.kill({proc.pid}, signal.SIGKILL)
    """))
    try:
        run = run_subprocess("train", "--plugin", "kill.py", "--reward.remote_urls", url, "--reward.remote_retries",
                             "2", *short_run("--train.steps", "5", "--train.run_name", "k"), cwd=tmp_path)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
    assert run.returncode == 2
    line = run.stderr.strip().splitlines()[-1]
    assert f"reward server {url} failed 2 times; last: ConnectError" in line
    assert "the run is kept in" in line and len(metrics_of(tmp_path / "runs" / "k")) == 2


def test_serving_a_reward_model(tmp_path, tiny_model):
    from rlhf_plugins.models.reward_model import RewardModelScorer

    folder = make_reward_model(tmp_path / "rm", "trl", seed=3)
    proc, url = serve("--model", str(folder))
    try:
        scorer = RewardModelScorer(str(folder))
        ids = scorer.render("3+4=", "7")
        query = scorer.tokenizer.decode(ids)
        got = httpx.post(url, json={"query": [query]}, timeout=30).json()["rewards"]
        assert got[0] == pytest.approx(scorer.score_ids([ids])[0], abs=1e-4)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
