"""`mla-ops ask`: the original ask_DeepSeek-V2-Lite-Chat.py, offline, on any device.

Loads a local DeepSeek-V2 checkpoint (or the built-in model), optionally routes parts of it through
torch.ops.mla (--use_pto: RMSNorm, --use_rope: RoPE, --use_kv_fusion: the fused KV prolog), optionally
compiles it for graph execution (--use_acl_graph), generates an answer and reports the original
script's metrics: load time and peak memory, tokenize time, generation time, generated tokens,
tokens/s and generation peak memory (plus time to first token and decode tokens/s).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import platform
import time

import torch

from .runtime import CliError, PeakMemory, check_writable, first_line, offline_environment, resolve_device, timed

DEFAULT_PROMPT = "What is the Python module collections for?"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_argument_group("input and model")
    src.add_argument("--prompt", help="the question to ask; wins over --sentence_file "
                                      f"(default when neither is given: {DEFAULT_PROMPT!r})")
    src.add_argument("--sentence_file", help="read the prompt from this text file (its lines joined with newlines)")
    src.add_argument("--model-path", "--model_path", dest="model_path", default=os.environ.get("MODEL_PATH"),
                     help="local checkpoint directory (config.json, *.safetensors, tokenizer files); defaults to "
                          "$MODEL_PATH; without either, the built-in model answers: a 3.4M-parameter DeepSeek-V2 "
                          "trained on Python's standard-library docstrings")
    src.add_argument("--device", default="cpu",
                     help="cpu, or an accelerator index as in the original script (0, 1, ...: an Ascend NPU "
                          "with torch_npu, else a CUDA GPU), or npu:N / cuda:N (default: cpu)")
    src.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                     help="weights and activations dtype (default auto: the checkpoint's dtype, bf16 for the "
                          "built-in model)")
    src.add_argument("--trust-remote-code", action="store_true",
                     help="run the checkpoint's own modeling code (modeling_deepseek.py) instead of transformers' "
                          "native DeepSeek-V2; only with code you trust")
    src.add_argument("--allow-pickle", action="store_true",
                     help="allow pickle weights (*.bin/*.pt) when the checkpoint has no safetensors; pickle can run "
                          "arbitrary code")
    src.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"],
                     help="attention kernel (default: sdpa; remote code without SDPA, such as DeepSeek-V2's, runs "
                          "its eager attention)")
    gen = parser.add_argument_group("generation")
    gen.add_argument("--output_length", "--output-length", dest="output_length", type=int, default=100,
                     help="maximum new tokens (default: 100)")
    gen.add_argument("--min-output-length", type=int, default=None,
                     help="force at least this many new tokens (default: none: the answer ends at the model's end "
                          "token)")
    gen.add_argument("--no-chat-template", action="store_true",
                     help="feed the prompt as plain text even when the tokenizer has a chat template")
    gen.add_argument("--no-stream", action="store_true", help="do not print tokens while they are generated")
    ops = parser.add_argument_group("mla ops (the original flags)")
    ops.add_argument("--use_pto", "--use-pto", dest="use_pto", action="store_true",
                     help="route every DeepseekV2RMSNorm (input, post-attention, final and kv_a norms) through "
                          "torch.ops.mla.rms_norm. The name is the original script's, where it selected its PyPTO "
                          "RMSNorm kernel; here it routes RMSNorm through the mla op on any device (the op's "
                          "backend decides the kernel). It does not route the KV prolog: that is --use_kv_fusion")
    ops.add_argument("--use_rope", "--use-rope", dest="use_rope", action="store_true",
                     help="RoPE of q_pe (and k_pe) through torch.ops.mla.rope")
    ops.add_argument("--use_kv_fusion", "--use-kv-fusion", dest="use_kv_fusion", action="store_true",
                     help="the MLA KV prolog through the fused torch.ops.mla.kv_prolog")
    ops.add_argument("--cache", default="dense", choices=["dense", "paged"],
                     help="with --use_kv_fusion: 'dense' caches full per-head K/V (the original design); 'paged' "
                          "keeps the 576-value MLA latent in a paged cache and decodes with absorbed attention")
    ops.add_argument("--use_acl_graph", "--use-acl-graph", dest="use_acl_graph", action="store_true",
                     help="graph execution: torchair aclgraph on NPU, CUDA graphs on GPU, inductor fullgraph on CPU")
    out = parser.add_argument_group("output")
    out.add_argument("--report-file", "--report_file", dest="report_file",
                     help="write the metrics as JSON to this file")
    out.add_argument("--quiet", action="store_true", help="print only the answer and the metrics")


def read_prompt(args) -> str:
    if args.prompt is not None:
        if not args.prompt.strip():
            raise CliError("--prompt is empty; give the question text, or leave --prompt out for the default "
                           "question")
        return args.prompt
    if args.sentence_file:
        path = pathlib.Path(args.sentence_file)
        if not path.is_file():
            raise CliError(f"--sentence_file {path}: no such file")
        try:
            content = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise CliError(f"--sentence_file {path}: not UTF-8 text (byte {exc.start}); give a plain text "
                           f"file") from None
        if "\x00" in content:  # NUL bytes decode as UTF-8 but mean a binary file
            raise CliError(f"--sentence_file {path}: a binary file (it contains NUL bytes); give a plain text file")
        lines = [line.rstrip("\n") for line in content.splitlines()]
        text = "\n".join(line for line in lines if line.strip())
        if not text:
            raise CliError(f"--sentence_file {path}: the file is empty")
        return text
    return DEFAULT_PROMPT


def _validate(args) -> None:
    if args.output_length <= 0:
        raise CliError(f"--output_length must be positive, got {args.output_length}")
    if args.min_output_length is not None and not 0 <= args.min_output_length <= args.output_length:
        raise CliError(f"--min-output-length must be between 0 and --output_length ({args.output_length})")
    if args.cache == "paged" and not args.use_kv_fusion:
        raise CliError("--cache paged needs --use_kv_fusion (the paged latent cache is fed by the fused prolog)")
    if args.report_file:
        check_writable("--report-file", args.report_file)


class _TimingStreamer:
    """A transformers streamer that records when each token arrives (and optionally prints text)."""

    def __init__(self, tokenizer, show: bool):
        from transformers import TextStreamer

        self.text = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if show else None
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value):
        if not self._prompt_seen:  # the first put() is the prompt
            self._prompt_seen = True
        else:
            self.times.append(time.perf_counter())
        if self.text is not None:
            self.text.put(value)

    def end(self):
        if self.text is not None:
            self.text.end()


def _routed_ops(options: dict, shared_kv: bool = False) -> list[str]:
    """The mla ops the patch options run the model through: the dense cache's KV path is one
    kv_prolog; the paged cache's is latent_kv_prolog into the cache and absorbed decode out of it.
    DeepSeek-V4 (`shared_kv`) runs its prologs, compressors, indexer and inverse RoPE on the ops, and with
    the paged cache its attention too."""
    if shared_kv:
        ops = ["shared_kv_q_prolog", "shared_kv_prolog", "kv_compressor", "lightning_indexer", "rope"]
        return ops + (["scatter_pa_cache", "shared_kv_attention"] if options["cache"] == "paged" else [])
    ops = []
    if options["kv_prolog"]:
        ops += ["kv_prolog"] if options["cache"] == "dense" else ["latent_kv_prolog", "scatter_pa_kv_cache",
                                                                  "mla_decode_attention"]
    return ops + [name for name in ("rms_norm", "rope") if options[name]]


def _check_remote_code_flags(args) -> None:
    """Flags the hub remote code cannot take, refused before loading (a real checkpoint loads for minutes):
    its attention is patched through the fused KV prolog only, onto its own dense K/V cache, and its
    model class has no static cache for graph mode to compile."""
    if args.cache == "paged":
        raise CliError("--cache paged: the checkpoint's remote code (--trust-remote-code) keeps its own dense K/V "
                       "cache; the paged latent cache needs transformers' native DeepSeek-V2 (run without "
                       "--trust-remote-code on transformers 5.x), or use --cache dense")
    if args.use_rope and not args.use_kv_fusion:
        raise CliError("--use_rope on the checkpoint's remote code needs --use_kv_fusion: its attention is routed "
                       "through mla.kv_prolog, and --use_rope adds the query's RoPE to that")
    if args.use_acl_graph:
        raise CliError("--use_acl_graph: graph mode decodes with a static cache, which the checkpoint's remote code "
                       "does not support; run without --use_acl_graph, or without --trust-remote-code on "
                       "transformers 5.x (its native DeepSeek-V2)")


def run(args) -> dict:
    _validate(args)
    offline_environment()
    prompt = read_prompt(args)
    device = resolve_device(args.device)
    say = (lambda msg: None) if args.quiet else (lambda msg: print(f"[mla-ops] {msg}", flush=True))
    from . import loading

    if loading.runs_remote_code(args.model_path, args.trust_remote_code):
        _check_remote_code_flags(args)
    from ..integrations.transformers import remote_code
    from ..integrations.transformers.patch import patch
    from ..integrations.transformers.shared_kv import is_shared_kv_attention

    memory = PeakMemory(device)
    memory.reset()
    with timed(device) as load_time:
        loaded = loading.load(args.model_path, args.dtype, device, trust_remote_code=args.trust_remote_code,
                              allow_pickle=args.allow_pickle, attn=args.attn, builtin="chat", progress=say)
    load_peak = memory.peak_mb()
    for note in loaded.notes:
        say(f"NOTE: {note}")
    model, tokenizer = loaded.model, loaded.tokenizer
    say(f"loaded {loaded.source} on {device} ({loaded.dtype}) in {load_time['seconds']:.2f} s")

    options = dict(kv_prolog=args.use_kv_fusion, rms_norm=args.use_pto, rope=args.use_rope,
                   cache=args.cache)  # _validate refused --cache paged without --use_kv_fusion
    handle = None
    if args.use_kv_fusion or args.use_pto or args.use_rope:
        try:
            handle = patch(model, **options)
        except (ValueError, NotImplementedError) as exc:  # a model these flags cannot patch: patch says why
            raise CliError(f"the mla flags cannot patch this model: {exc}") from None
        shared_kv = any(is_shared_kv_attention(m) for m in model.modules())
        say(f"routed through torch.ops.mla: {', '.join(_routed_ops(options, shared_kv))}"
            + (f" (cache={options['cache']})" if args.use_kv_fusion else ""))
        if device.type == "npu" and options["cache"] == "dense" and args.use_kv_fusion:
            # (the paged mode calls latent_kv_prolog, which has no NPU kernel to compile)
            from ..backends import npu

            say(f"compiling the NPU kv_prolog kernels for {npu.warmup_token_counts()} tokens")
            remote = any(remote_code.is_remote_attention(m) for m in model.modules())
            npu.warmup(model, rope_layout="half" if remote else "interleaved")
    else:
        say("baseline: the stock transformers model (no mla op)")

    generate_kwargs = dict(max_new_tokens=args.output_length, do_sample=False)
    if args.min_output_length:
        generate_kwargs["min_new_tokens"] = args.min_output_length
    if args.use_acl_graph:
        from .graph import compile_settings

        generate_kwargs.update(compile_settings(device, say))

    with timed(device) as tok_time:
        use_template = getattr(tokenizer, "chat_template", None) and not args.no_chat_template
        if use_template:
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                 tokenize=False)
            encoded = tokenizer(text, return_tensors="pt", add_special_tokens=False)
        else:
            encoded = tokenizer(prompt, return_tensors="pt")
        input_ids = encoded.input_ids.to(device)
        attention_mask = encoded.attention_mask.to(device)

    # A cache is sized (graph mode) or may grow (paged, dense) for prompt + --output_length tokens:
    # past the model's positions that is no answer, and past the machine's memory an allocator
    # traceback. Refused before any generation.
    max_positions = getattr(model.config, "max_position_embeddings", None)
    if max_positions and input_ids.shape[1] + args.output_length > max_positions:
        raise CliError(f"--output_length {args.output_length}: the prompt ({input_ids.shape[1]} tokens) plus this "
                       f"many new tokens exceeds the model's {max_positions} positions (max_position_embeddings); "
                       f"lower --output_length to at most {max(max_positions - input_ids.shape[1], 0)}")
    compile_seconds = None
    if args.use_acl_graph:
        # One static cache size for warm-up and the measured run, so the compiled step is reused.
        generate_kwargs["max_cache_len"] = input_ids.shape[1] + args.output_length
        # Compile outside the timed generation, as the original warmed up before measuring: a
        # two-token generate traces and compiles the decode step (transformers compiles decode only).
        say("graph mode: compiling the decode step (warm-up generate of 2 tokens)")
        with torch.no_grad(), timed(device) as warm, _cache_fits(args):
            model.generate(input_ids, attention_mask=attention_mask, **{**generate_kwargs, "max_new_tokens": 2,
                                                                        "min_new_tokens": 2})
        compile_seconds = warm["seconds"]
        say(f"graph mode: ready after {compile_seconds:.1f} s")

    streamer = _TimingStreamer(tokenizer, show=not args.no_stream and not args.quiet)
    if not args.quiet:
        print(f"\nQ: {prompt}\nA: ", end="", flush=True)
    memory.reset()
    try:
        with torch.no_grad(), timed(device) as gen_time, _cache_fits(args):
            start = time.perf_counter()
            output = model.generate(input_ids, attention_mask=attention_mask, streamer=streamer, **generate_kwargs)
    finally:
        if handle is not None:
            handle.revert()
    gen_peak = memory.peak_mb()
    new_tokens = output[0, input_ids.shape[1]:]
    answer = tokenizer.decode(new_tokens, skip_special_tokens=True)
    generated = int(new_tokens.numel())
    seconds = gen_time["seconds"]
    first = streamer.times[0] - start if streamer.times else float("nan")
    decode_rate = ((len(streamer.times) - 1) / (streamer.times[-1] - streamer.times[0])
                   if len(streamer.times) > 1 else float("nan"))
    report = {
        "model": loaded.source, "device": str(device), "dtype": str(loaded.dtype).removeprefix("torch."),
        "options": {"use_pto": args.use_pto, "use_rope": args.use_rope, "use_kv_fusion": args.use_kv_fusion,
                    "cache": options["cache"], "use_acl_graph": args.use_acl_graph, "attn": args.attn},
        "prompt": prompt, "answer": answer, "chat_template": bool(use_template),
        "load_seconds": load_time["seconds"], "load_peak_memory_mb": load_peak,
        "tokenize_seconds": tok_time["seconds"], "prompt_tokens": int(input_ids.shape[1]),
        "generation_seconds": seconds, "generated_tokens": generated,
        "tokens_per_second": generated / seconds if seconds > 0 else float("nan"),
        "time_to_first_token_seconds": first, "decode_tokens_per_second": decode_rate,
        "generation_peak_memory_mb": gen_peak, "memory_measure": memory.source,
        "graph_compile_seconds": compile_seconds,
        "notes": loaded.notes,
        "versions": {"torch": torch.__version__, "transformers": _version("transformers"),
                     "mla_ops": _version("mla-ops"), "python": platform.python_version()},
    }
    if args.quiet or args.no_stream:  # the streamer printed nothing
        print(answer)
    print()
    _print_metrics(report)
    if args.report_file:
        path = pathlib.Path(args.report_file).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        print(f"report written to {path}")
    return report


_ALLOCATION_FAILURES = ("can't allocate memory", "out of memory", "not enough memory", "negative dimension",
                        "invalid buffer size", "std::bad_alloc")


@contextlib.contextmanager
def _cache_fits(args):
    """A cache sized for prompt + --output_length tokens (the static cache of graph mode) that the
    machine cannot allocate: one line naming --output_length, not an allocator traceback."""
    try:
        yield
    except (MemoryError, RuntimeError) as exc:  # torch.OutOfMemoryError is a RuntimeError
        if not isinstance(exc, MemoryError) and not any(k in str(exc) for k in _ALLOCATION_FAILURES):
            raise
        raise CliError(f"--output_length {args.output_length}: the cache for the prompt plus this many tokens does "
                       f"not fit in memory ({first_line(exc)[:160]}); lower --output_length") from None


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "unknown"


def _print_metrics(r: dict) -> None:
    print("=" * 60)
    rows = [
        ("model", f"{r['model']} ({r['dtype']} on {r['device']})"),
        ("mla ops", ", ".join(k for k, v in r["options"].items() if v is True) or "none (baseline)"),
        ("load time", f"{r['load_seconds']:.2f} s (peak memory {r['load_peak_memory_mb']:.0f} MB)"),
        ("tokenize time", f"{r['tokenize_seconds'] * 1e3:.2f} ms ({r['prompt_tokens']} prompt tokens)"),
        ("generation time", f"{r['generation_seconds']:.3f} s"),
        ("generated tokens", str(r["generated_tokens"])),
        ("throughput", f"{r['tokens_per_second']:.2f} tokens/s (first token {r['time_to_first_token_seconds']:.3f} s, "
                       f"decode {r['decode_tokens_per_second']:.2f} tokens/s)"),
        ("generation peak memory", f"{r['generation_peak_memory_mb']:.0f} MB ({r['memory_measure']})"),
    ]
    if r["graph_compile_seconds"] is not None:
        rows.insert(2, ("graph compile", f"{r['graph_compile_seconds']:.1f} s (warm-up, not in generation time)"))
    for name, value in rows:
        print(f"{name:<24}{value}")
    print("=" * 60)
