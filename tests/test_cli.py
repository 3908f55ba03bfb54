"""The command line: `mla-ops ask` on the built-in model and on a saved checkpoint, `mla-ops bench`."""
import itertools
import json
import os
import subprocess
import sys

import pytest
import torch

from mla_ops.cli import main

from utils import MlaCalls

# whole models, generate and compile: `make test-fast` leaves these to `make test`
pytestmark = pytest.mark.slow

ENV = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", HF_HUB_OFFLINE="1")
ENV.pop("MODEL_PATH", None)
REPORT_FIELDS = {"load_seconds", "load_peak_memory_mb", "tokenize_seconds", "generation_seconds", "generated_tokens",
                 "tokens_per_second", "generation_peak_memory_mb", "prompt_tokens", "answer", "options", "model"}


def run_cli(*args, env=None, timeout=600):
    """The installed console script in a fresh process: exit code, stdout, stderr."""
    proc = subprocess.run([sys.executable, "-m", "mla_ops", *args], capture_output=True, text=True,
                          env=env or ENV, timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.fixture(autouse=True)
def _no_model_path(monkeypatch):
    monkeypatch.delenv("MODEL_PATH", raising=False)


def test_ask_subprocess_builtin_model_with_report(tmp_path):
    """The default question on the built-in (trained) model: the output says what the model is, and
    the answer is words, not byte soup."""
    from mla_ops.cli.ask import DEFAULT_PROMPT
    from mla_ops.cli.loading import BUILTIN_MODEL_DESCRIPTION

    report_file = tmp_path / "report.json"
    code, out, err = run_cli("ask", "--output_length", "24", "--use_kv_fusion", "--report-file", str(report_file))
    assert code == 0, err
    assert BUILTIN_MODEL_DESCRIPTION in out and f"Q: {DEFAULT_PROMPT}" in out
    report = json.loads(report_file.read_text())
    assert REPORT_FIELDS <= set(report)
    assert 0 < report["generated_tokens"] <= 24 and report["model"] == "built-in"
    assert report["options"]["use_kv_fusion"] and report["chat_template"]
    assert report["tokens_per_second"] > 0 and report["generation_peak_memory_mb"] > 0
    answer = report["answer"].strip()
    words = answer.split()
    assert answer.isprintable() and len(words) >= 3, answer
    # mostly dictionary-shaped words: letters with at most trailing punctuation
    assert sum(w.strip(".,;:()'\"").isalpha() for w in words) >= 0.7 * len(words), answer
    # the model learned its answers nearly word for word: the default question's is the docstring of
    # `collections` (docs/builtin-model.md), which its first words give away
    assert answer.startswith("This module implements specialized container datatypes"), answer


def test_builtin_model_weights_are_small_and_load_with_their_config():
    """The committed weights: safetensors of at most 10 MB, exactly the tensors of the committed
    config's DeepSeek-V2 (MLA attention), the size the command line states."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from mla_ops.cli.loading import BUILTIN_MODEL, BUILTIN_MODEL_DESCRIPTION, builtin_tokenizer

    weights = BUILTIN_MODEL / "model.safetensors"
    assert weights.stat().st_size <= 10_000_000
    config = AutoConfig.from_pretrained(BUILTIN_MODEL, local_files_only=True)
    assert config.model_type == "deepseek_v2" and config.vocab_size == len(builtin_tokenizer())
    assert min(config.kv_lora_rank, config.qk_rope_head_dim, config.qk_nope_head_dim, config.v_head_dim) > 0
    model = AutoModelForCausalLM.from_config(config)
    state = load_file(weights)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not missing and not unexpected
    assert all(t.dtype == torch.bfloat16 for t in state.values())
    params = sum(t.numel() for t in state.values())
    assert f"a {params / 1e6:.1f}M-parameter" in BUILTIN_MODEL_DESCRIPTION


# Every CPU-runnable combination of the original flags (+ the cache mode of --use_kv_fusion).
FLAG_SETS = []
for pto, rope, kv, graph in itertools.product([False, True], repeat=4):
    for cache in (["dense", "paged"] if kv else ["dense"]):
        flags = [f for f, on in (("--use_pto", pto), ("--use_rope", rope), ("--use_kv_fusion", kv),
                                 ("--use_acl_graph", graph)) if on]
        if kv:
            flags += ["--cache", cache]
        FLAG_SETS.append(pytest.param(flags,
                                      id=" ".join(flags) or "baseline"))


def builtin_layers() -> int:
    from mla_ops.cli.loading import BUILTIN_MODEL

    return json.loads((BUILTIN_MODEL / "config.json").read_text())["num_hidden_layers"]


def expected_mla_calls(flags, layers=None, forwards=5):
    """torch.ops.mla calls one eager ask makes: per layer and forward (1 prefill + 4 decode steps)."""
    kv, paged = "--use_kv_fusion" in flags, "paged" in flags
    layers = layers or builtin_layers()
    per_forward = {}
    if "--use_pto" in flags:  # input + post-attention norms (+ kv_a_layernorm unless fused), final norm
        per_forward["rms_norm"] = (2 if kv else 3) * layers + 1
    if "--use_rope" in flags or paged:  # q_pe and k_pe, or only q_pe once the prolog rotates k_pe
        per_forward["rope"] = (1 if kv else 2) * layers
    if kv and not paged:
        per_forward["kv_prolog"] = layers
    if paged:
        per_forward["latent_kv_prolog"] = per_forward["scatter_pa_kv_cache"] = layers
    calls = {op: n * forwards for op, n in per_forward.items()}
    if paged:  # decode steps attend over the latent cache; the prefill attends densely
        calls["mla_decode_attention"] = layers * (forwards - 1)
    return calls


ASK_FP32 = ["ask", "--output_length", "5", "--min-output-length", "5", "--dtype", "fp32", "--no-stream"]


@pytest.fixture(scope="module")
def baseline_answer(tmp_path_factory):
    """The stock model's answer, computed once for every flag combination to compare with."""
    report_file = tmp_path_factory.mktemp("baseline") / "base.json"
    assert main([*ASK_FP32, "--report-file", str(report_file)]) == 0
    return json.loads(report_file.read_text())["answer"]


@pytest.mark.parametrize("flags", FLAG_SETS)
def test_ask_every_cpu_flag_combination(flags, baseline_answer, tmp_path, capsys):
    """In-process (the subprocess path is covered above), on the built-in model and the default question:
    same tokens as the baseline, since every mla path reproduces stock transformers' greedy tokens on this
    model (fp32 to rule out bf16 ties), and (eager runs) exactly the mla ops each flag routes."""
    report_file = tmp_path / "r.json"
    torch._dynamo.reset()  # one process runs many graph-mode asks here; a CLI run compiles once
    if "--use_acl_graph" in flags:  # Dynamo does not compile under an active dispatch mode: no counting
        torch._dynamo.utils.counters.clear()
        assert main([*ASK_FP32, *flags, "--report-file", str(report_file)]) == 0
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1, "graph mode compiled nothing"
    else:
        with MlaCalls() as calls:
            assert main([*ASK_FP32, *flags, "--report-file", str(report_file)]) == 0
        assert calls.counts == expected_mla_calls(flags)
    report = json.loads(report_file.read_text())
    assert report["generated_tokens"] == 5
    assert report["answer"] == baseline_answer
    if "--use_acl_graph" in flags:
        assert report["graph_compile_seconds"] > 0


def test_sentence_file_and_prompt_precedence(tmp_path, capsys):
    sentences = tmp_path / "q.txt"
    sentences.write_text("first line\n\nsecond line\n", encoding="utf-8")
    assert main(["ask", "--sentence_file", str(sentences), "--output_length", "2", "--no-stream",
                 "--report-file", str(tmp_path / "a.json")]) == 0
    assert json.loads((tmp_path / "a.json").read_text())["prompt"] == "first line\nsecond line"
    assert main(["ask", "--sentence_file", str(sentences), "--prompt", "wins", "--output_length", "2",
                 "--no-stream", "--report-file", str(tmp_path / "b.json")]) == 0
    assert json.loads((tmp_path / "b.json").read_text())["prompt"] == "wins"


@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory):
    """A small DeepSeek-V2 saved the way a user would have it: save_pretrained (safetensors) + tokenizer."""
    from mla_ops.cli.loading import lite_dims_model

    directory = tmp_path_factory.mktemp("checkpoint")
    model, tokenizer = lite_dims_model(torch.bfloat16, torch.device("cpu"), seed=3)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory, model, tokenizer


def test_ask_loads_a_local_safetensors_checkpoint(saved_checkpoint, tmp_path):
    directory, model, tokenizer = saved_checkpoint
    assert list(directory.glob("*.safetensors"))
    report_file = tmp_path / "ckpt.json"
    code, out, err = run_cli("ask", "--model-path", str(directory), "--prompt", "hello", "--output_length", "4",
                             "--min-output-length", "4", "--use_kv_fusion", "--report-file", str(report_file))
    assert code == 0, err
    report = json.loads(report_file.read_text())
    assert report["model"] == str(directory) and report["dtype"] == "bfloat16"
    # the same tokens as generating with the in-memory model
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True,
                                         tokenize=False)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert report["answer"] == tokenizer.decode(expected[0, ids.shape[1]:], skip_special_tokens=True)
    # $MODEL_PATH is the fallback for --model-path
    code, out, err = run_cli("ask", "--prompt", "hello", "--output_length", "2", "--quiet",
                             env=dict(ENV, MODEL_PATH=str(directory)))
    assert code == 0 and str(directory) in out, err


def test_pickle_weights_are_refused_unless_allowed(saved_checkpoint, tmp_path):
    _, model, tokenizer = saved_checkpoint
    directory = tmp_path / "pickled"
    model.config.save_pretrained(directory)  # transformers 5 always writes safetensors: pickle by hand
    tokenizer.save_pretrained(directory)
    torch.save(model.state_dict(), directory / "pytorch_model.bin")
    assert not list(directory.glob("*.safetensors")) and list(directory.glob("*.bin"))
    code, out, err = run_cli("ask", "--model-path", str(directory), "--output_length", "2")
    assert code == 2 and "pickle" in err and "--allow-pickle" in err, (out, err)
    code, out, err = run_cli("ask", "--model-path", str(directory), "--output_length", "2", "--allow-pickle",
                             "--quiet")
    assert code == 0, err


@pytest.mark.parametrize("args,message", [
    (["ask", "--model-path", "/nonexistent/ckpt"], "--model-path /nonexistent/ckpt: no such directory"),
    (["ask", "--sentence_file", "/nonexistent/q.txt"], "--sentence_file /nonexistent/q.txt: no such file"),
    (["ask", "--output_length", "0"], "--output_length must be positive"),
    (["ask", "--cache", "paged"], "--cache paged needs --use_kv_fusion"),
    (["ask", "--device", "3"], "no NPU (torch_npu) or CUDA device is available"),
    (["ask", "--device", "tpu9x"], "is not a device"),
    (["bench", "e2e", "--fused", "magic"], "--fused 'magic': choose from kv_fusion, rope, pto"),
])
def test_bad_arguments_exit_nonzero_with_a_clear_message(args, message, capsys):
    assert main(args) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("args,message", [
    (["bench", "e2e", "--repeats", "0"], "argument --repeats: expected an integer >= 1, got 0"),
    (["bench", "e2e", "--warmup", "-1"], "argument --warmup: expected an integer >= 0, got -1"),
    (["bench", "ops", "--threads", "two"], "argument --threads: expected an integer, got 'two'"),
    (["bench", "e2e", "--prompt-lengths", "32,0"], "expected positive integers"),
])
def test_bad_numbers_are_refused_by_the_parser(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_missing_config_and_unknown_flags(tmp_path, capsys):
    (tmp_path / "weights.safetensors").write_bytes(b"")
    assert main(["ask", "--model-path", str(tmp_path)]) == 2
    assert "config.json is missing" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["ask", "--use-magic"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0 and "ask" in capsys.readouterr().out


def test_ask_help_explains_every_flag(capsys):
    with pytest.raises(SystemExit):
        main(["ask", "--help"])
    text = capsys.readouterr().out
    for flag in ("--prompt", "--sentence_file", "--device", "--model-path", "--output_length", "--use_pto",
                 "--use_rope", "--use_kv_fusion", "--use_acl_graph", "--report-file", "--dtype", "--cache",
                 "--trust-remote-code", "--allow-pickle"):
        assert flag in text


def test_bench_e2e_quick_writes_table_and_json(tmp_path, capsys):
    out_json = tmp_path / "e2e.json"
    assert main(["bench", "e2e", "--prompt-lengths", "8,16", "--output-lengths", "2,3", "--repeats", "1",
                 "--warmup", "0", "--json", str(out_json), "--plot", str(tmp_path / "e2e.png")]) == 0
    printed = capsys.readouterr().out
    assert "verdict" in printed and "baseline tok/s" in printed and "90% interval" in printed
    rows = json.loads(out_json.read_text())["rows"]
    assert [(r["prompt_tokens"], r["output_tokens"]) for r in rows] == [(8, 2), (8, 3), (16, 2), (16, 3)]
    # one ABBA block per row: two runs of each variant, too few for an interval, so no verdict
    assert all(len(r["baseline_runs_s"]) == len(r["fused_runs_s"]) == 2 and len(r["block_ratios"]) == 1
               for r in rows)
    assert all(r["verdict"] == "no verdict (needs 5+ repeats)" and r["ci_low"] is None for r in rows)
    assert "plot written" in printed or "plot skipped: matplotlib is not installed" in printed


def test_bench_metadata_has_no_machine_paths(saved_checkpoint, tmp_path, tmp_path_factory, monkeypatch, capsys):
    """The JSON's meta names the command as typed (`mla-ops ...`, not the interpreter's script path or
    the caller's argv) and holds no absolute path: paths inside the working directory become relative,
    others their final name (the checkpoint directory too)."""
    directory = saved_checkpoint[0]
    monkeypatch.chdir(tmp_path)
    plot = tmp_path_factory.mktemp("elsewhere") / "e2e.png"
    assert main(["bench", "e2e", "--prompt-lengths", "8", "--output-lengths", "2", "--repeats", "1", "--warmup", "0",
                 "--model-path", str(directory), "--plot", str(plot),
                 "--json", str(tmp_path / "results" / "e2e.json")]) == 0
    capsys.readouterr()
    meta = json.loads((tmp_path / "results" / "e2e.json").read_text())["meta"]
    assert meta["command"] == (f"mla-ops bench e2e --prompt-lengths 8 --output-lengths 2 --repeats 1 --warmup 0 "
                               f"--model-path {directory.name} --plot e2e.png --json results/e2e.json")
    assert meta["model"] == directory.name

    def strings(value):
        if isinstance(value, dict):
            return [s for v in value.values() for s in strings(v)]
        if isinstance(value, list):
            return [s for v in value for s in strings(v)]
        return [value] if isinstance(value, str) else []

    machine_dirs = {str(tmp_path), str(directory), os.path.expanduser("~"), sys.prefix, sys.executable, os.getcwd()}
    for text in strings(meta):
        assert not os.path.isabs(text) and not any(d in text for d in machine_dirs), text


def test_cpu_clock_needs_one_thread(capsys):
    """Process CPU time is a run's duration only with one torch thread: refused before loading anything."""
    threads = torch.get_num_threads()
    try:
        assert main(["bench", "e2e", "--clock", "cpu", "--threads", "2"]) == 2
    finally:
        torch.set_num_threads(threads)
    out, err = capsys.readouterr()
    assert "--clock cpu needs --threads 1" in err and not out


def test_e2e_verdicts_need_the_difference_to_clear_the_noise():
    """Per-block ratios baseline / fused -> a verdict only where the median's 90% interval is clear of 1
    and the speedup beyond the 5% run-to-run floor; the band is in the "~Same" text."""
    from mla_ops.bench.e2e import verdict

    tight_win = [1.18, 1.2, 1.21, 1.19, 1.22, 1.2, 1.17, 1.23]
    assert verdict(tight_win)["verdict"] == "Fused faster"
    assert verdict([1 / r for r in tight_win])["verdict"] == "Baseline faster"
    # a tight 3% difference is inside the floor
    assert verdict([1.03, 1.02, 1.04, 1.03, 1.03, 1.02, 1.04, 1.03])["verdict"] == "~Same (within noise ±5%)"
    # the same median 1.2, but blocks as noisy as a busy machine makes them: the interval reaches below 1
    noisy = verdict([0.7, 0.95, 1.1, 1.2, 1.2, 1.3, 1.45, 1.9])
    assert noisy["speedup"] == 1.2 and noisy["ci_low"] == 0.95 and noisy["ci_high"] == 1.45
    assert noisy["verdict"] == "~Same (within noise ±26%)"  # 1.2 / 0.95: the side facing 1, in log space
    # blocks that went unusually well for the winner widen the far side only: still a win
    lucky = verdict([1.1, 1.11, 1.12, 1.12, 1.13, 1.13, 1.6, 1.9])
    assert lucky["ci_high"] == 1.6 and lucky["verdict"] == "Fused faster"
    assert verdict([1.5] * 4)["verdict"] == "no verdict (needs 5+ repeats)"


@pytest.mark.slow
def test_bench_ops_and_decode_quick(tmp_path, capsys):
    assert main(["bench", "ops", "--quick", "--json", str(tmp_path / "ops.json")]) == 0
    ops = json.loads((tmp_path / "ops.json").read_text())
    assert {r["S"] for r in ops["kv_prolog"]} == {1, 16}
    assert {r["variant"] for r in ops["paged_kv_cache"]} == {"copy_", "gather_pa_kv_cache", "scatter_pa_kv_cache"}
    assert main(["bench", "decode", "--quick", "--json", str(tmp_path / "decode.json")]) == 0
    decode = json.loads((tmp_path / "decode.json").read_text())
    paged = [r for r in decode["model_decode"] if r["variant"] == "paged"]
    assert paged and all(r["cache_bytes_per_token_per_layer"] < 2 * 1152 for r in paged)
    # another MLA family, the same measurement
    assert main(["bench", "decode", "--contexts", "64", "--family", "minicpm3",
                 "--json", str(tmp_path / "m.json")]) == 0
    minicpm3 = json.loads((tmp_path / "m.json").read_text())
    assert minicpm3["meta"]["family"] == "minicpm3"
    assert {r["variant"] for r in minicpm3["model_decode"]} == {"stock", "dense", "paged"}
    # a sparse family: the caches hold the indexer keys too (bf16 latent 512 + rope 64 + indexer key 128)
    assert main(["bench", "decode", "--contexts", "64", "--family", "deepseek_v32", "--heads", "4",
                 "--json", str(tmp_path / "v32.json")]) == 0
    v32 = json.loads((tmp_path / "v32.json").read_text())
    assert v32["meta"]["family"] == "deepseek_v32" and v32["meta"]["heads"] == 4
    stock = next(r for r in v32["model_decode"] if r["variant"] == "stock")
    assert stock["cache_bytes_per_token_per_layer"] == 2 * (512 + 64 + 128)


def test_info(capsys):
    assert main(["info"]) == 0
    text = capsys.readouterr().out
    assert "reference" in text and "pypto_sim" in text and "npu" in text
    # the MLA families of the installed transformers, read off their classes
    assert "transformers MLA families" in text
    assert "DeepseekV3Attention" in text and "supported" in text
    assert "DeepseekV32Attention" in text and "refused" not in text  # every family of transformers 5.24 is served
    assert "Glm5NextTextAttention" in text


# ------------------------------------------------------------------ inputs refused in one line
def _variant(saved_checkpoint, tmp_path, name):
    import shutil

    directory = tmp_path / name
    shutil.copytree(saved_checkpoint[0], directory)
    return directory


def _edit_config(directory, **changes):
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))


def _rewrite_weights(directory, edit):
    from safetensors.torch import load_file, save_file

    weights = load_file(directory / "model.safetensors")
    save_file(edit(weights), directory / "model.safetensors", metadata={"format": "pt"})


def _narrow_kv_b(weights):
    key = next(k for k in weights if k.endswith("kv_b_proj.weight"))
    return {**weights, key: weights[key][:, :-1].contiguous()}


def _pickle_with_an_object(directory):
    import argparse

    from safetensors.torch import load_file

    weights = load_file(directory / "model.safetensors")
    (directory / "model.safetensors").unlink()
    torch.save({**weights, "extra": argparse.Namespace(a=1)}, directory / "pytorch_model.bin")


CHECKPOINT_CASES = {
    "config-list": (lambda d: (d / "config.json").write_text("[1, 2]"), [],
                    "config.json must be a JSON object"),
    "truncated-safetensors": (lambda d: (d / "model.safetensors").write_bytes(
        (d / "model.safetensors").read_bytes()[:100_000]), [], "model.safetensors is not a readable safetensors file"),
    "garbage-safetensors": (lambda d: (d / "model.safetensors").write_bytes(b"\x13" * 1000), [],
                            "model.safetensors is not a readable safetensors file"),
    "wrong-shapes": (lambda d: _rewrite_weights(d, _narrow_kv_b), [],
                     r"1 weight\(s\) have shapes that do not match config.json \(model.layers.0.self_attn.kv_b_proj"),
    "llama-model-type": (lambda d: _edit_config(d, model_type="llama"), [],
                         "config.json says model_type 'llama', but mla-ops ask runs multi-head latent attention"),
    "missing-layer": (lambda d: _rewrite_weights(d, lambda w: {k: v for k, v in w.items() if ".layers.1." not in k}),
                      [], r"the checkpoint lacks \d+ weight\(s\) the model needs \(model.layers.1."),
    "pickle-the-safe-loader-refuses": (_pickle_with_an_object, ["--allow-pickle"],
                                       r"the safe loader .* refuses even with --allow-pickle"),
}


@pytest.mark.parametrize("case", list(CHECKPOINT_CASES))
def test_broken_checkpoints_are_one_line_errors(case, saved_checkpoint, tmp_path, capsys):
    import re

    edit, extra, message = CHECKPOINT_CASES[case]
    directory = _variant(saved_checkpoint, tmp_path, case)
    edit(directory)
    assert main(["ask", "--model-path", str(directory), "--output_length", "2", "--quiet", *extra]) == 2
    out, err = capsys.readouterr()
    error_lines = [line for line in err.splitlines() if line.startswith("mla-ops: error:")]
    assert len(error_lines) == 1 and re.search(message, error_lines[0]), err
    assert str(directory) in error_lines[0] and "A:" not in out


def _binary_file(tmp_path):
    path = tmp_path / "q.bin"
    path.write_bytes(bytes(range(256)) * 4)
    return str(path)


def _file_as_folder(tmp_path):
    (tmp_path / "afile").write_text("x")
    return str(tmp_path / "afile" / "out.json")


@pytest.mark.parametrize("make_args,message", [
    (lambda t: ["--prompt", ""], "--prompt is empty"),
    (lambda t: ["--prompt", "  "], "--prompt is empty"),
    (lambda t: ["--device", "mps"], "--device mps: device type 'mps' is not supported"),
    (lambda t: ["--device", "meta"], "--device meta: device type 'meta' is not supported"),
    (lambda t: ["--device", "xpu:0"], "--device xpu:0: device type 'xpu' is not supported"),
    (lambda t: ["--sentence_file", _binary_file(t)], "not UTF-8 text"),
    (lambda t: ["--output_length", str(10**12), "--use_acl_graph"],
     r"--output_length 1000000000000: the prompt \(\d+ tokens\) plus this many new tokens exceeds"),
    (lambda t: ["--output_length", str(10**12), "--use_kv_fusion", "--cache", "paged"],
     r"exceeds the model's \d+ positions"),
    (lambda t: ["--report-file", _file_as_folder(t)], "--report-file .*out.json: cannot be written"),
    (lambda t: ["--report-file", str(t)], "is a directory"),
], ids=["empty-prompt", "blank-prompt", "mps", "meta", "xpu", "binary-sentence-file", "huge-output-acl-graph",
        "huge-output-paged", "report-under-a-file", "report-is-a-folder"])
def test_bad_ask_inputs_are_one_line_errors_before_any_generation(make_args, message, tmp_path, capsys):
    import re

    assert main(["ask", "--output_length", "2", *make_args(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert re.search(message, err) and err.count("\n") == 1 and err.startswith("mla-ops: error:"), err
    assert "A:" not in out  # refused before the generation


@pytest.mark.parametrize("args", [["bench", "ops", "--quick", "--json"], ["bench", "e2e", "--quick", "--plot"]],
                         ids=["bench-json", "bench-plot"])
def test_unwritable_bench_outputs_are_refused_before_measuring(args, tmp_path, capsys):
    assert main([*args, _file_as_folder(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert "cannot be written" in err and not out  # no table: nothing was measured


def test_bench_vllm_auto_route_of_a_sparse_family_is_refused_before_measuring(tmp_path, capsys):
    json_path = tmp_path / "out.json"
    assert main(["bench", "vllm", "--family", "deepseek_v32", "--auto-route", "--json", str(json_path)]) == 2
    out, err = capsys.readouterr()
    assert "--auto-route" in err and "deepseek_v32" in err and not out and not json_path.exists()


def test_a_refusal_in_a_fresh_process_has_no_traceback(tmp_path):
    code, out, err = run_cli("ask", "--sentence_file", _binary_file(tmp_path))
    assert code == 2 and "Traceback" not in err and err.strip().count("\n") == 0, err


def test_selftest_pypto_sim_only_on_cpu():
    code, _, err = run_cli("selftest", "--device", "cuda:0", "--pypto-sim")
    assert code == 2 and ("--pypto-sim runs the PyPTO kernels on CPU" in err or "CUDA is not available" in err)
