"""DeepSeek-V4's shared-KV prologs (`mla.shared_kv_q_prolog`, `mla.shared_kv_prolog`) and KV compressor
(`mla.kv_compressor`) against goldens nobody here wrote: the stock transformers 5.24 DeepSeek-V4 modules.

Bit for bit, in fp32 and in a bf16 model built with `dtype=` (norm weights, sinks and position_bias stay
fp32): the prologs against the q / kv the stock attention computes inside a model forward, the compressor
against the entries the stock CSA / HCA compressors (and the CSA indexer's compressor) keep in a stock
`DynamicCache` over one-shot prefill, chunked prefill and decode, for two requests at once in one paged
pool. Two configs: the rotary dim R = 8 of a tiny model and R = 64 of V4-Flash. Also the inverse rope
(`mla.rope` with -sin) against the stock one, the argument errors, opcheck and torch.compile."""
import copy
import functools

import pytest
import torch
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM, DynamicCache
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

import mla_ops  # noqa: F401  (defines torch.ops.mla)
from mla_ops.ops.kv_compressor import kv_compressor_sync_free
from mla_ops.testing.suites import GraphCapture

from utils import opcheck

DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = ["fp32", "bf16"]
ROPE_DIMS = [8, 64]
CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"


# ---------------------------------------------------------------------------------------- models
def _config(rope_dim: int) -> DeepseekV4Config:
    """One layer of each type (sliding, CSA, HCA); 8 indexer heads (no exact index-score ties)."""
    common = dict(vocab_size=128, hidden_size=64, num_hidden_layers=3, layer_types=["sliding_attention", CSA, HCA],
                  mlp_layer_types=["hash_moe", "moe", "moe"], num_key_value_heads=1, q_lora_rank=32, o_lora_rank=16,
                  index_n_heads=8, index_topk=4, sliding_window=8, moe_intermediate_size=32, n_routed_experts=4,
                  num_experts_per_tok=2, n_shared_experts=1, hc_mult=4, max_position_embeddings=4096,
                  rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 256,
                                   "beta_fast": 32, "beta_slow": 1})
    if rope_dim == 8:  # the tiny model: head_dim 32, R = 8; HCA every 8 tokens
        return DeepseekV4Config(**common, num_attention_heads=4, head_dim=32, partial_rotary_factor=0.25, o_groups=2,
                                index_head_dim=16, compress_rates={CSA: 4, HCA: 8})
    # V4-Flash's rotary dim: head_dim 128, R = 64; the indexer's rows are all rotary (Di = R); HCA every 16
    return DeepseekV4Config(**common, num_attention_heads=2, head_dim=128, partial_rotary_factor=0.5, o_groups=2,
                            index_head_dim=64, compress_rates={CSA: 4, HCA: 16})


@functools.lru_cache(maxsize=None)
def _model(rope_dim: int, dtype: torch.dtype):
    config = _config(rope_dim)
    assert config.qk_rope_head_dim == rope_dim
    torch.manual_seed(0)
    model = (DeepseekV4ForCausalLM(config) if dtype == torch.float32
             else DeepseekV4ForCausalLM._from_config(config, dtype=dtype)).eval()
    with torch.no_grad():  # stock init leaves sinks = position_bias = 0 and norm weights = 1: bugs would hide
        for name, param in model.named_parameters():
            if name.endswith(("sinks", "position_bias")) or "norm.weight" in name:
                param.normal_()
    return config, model


def _attention(model, layer_type: str):
    return next(layer.self_attn for layer in model.model.layers if layer.self_attn.layer_type == layer_type)


# ------------------------------------------------------------------------------------------ prologs
@pytest.mark.parametrize("rope_dim", ROPE_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_prologs_and_inverse_rope_bit_identical_to_stock_attention(monkeypatch, dtype, rope_dim):
    """Inside a stock model forward (2 prompts of 19 tokens, every layer type with its own rope table),
    the q, q_residual and K = V rows the stock attention computes, and its inverse rope of the output, are
    what the ops compute from the attention's own input, weights and tables."""
    config, model = _model(rope_dim, dtype)
    assert model.model.layers[1].self_attn.q_a_norm.weight.dtype == torch.float32  # kept fp32 in bf16
    calls = []  # (inputs, output) of every stock apply_rotary_pos_emb call, in order
    stock_rope = hf.apply_rotary_pos_emb

    def recording_rope(x, cos, sin, *args, **kwargs):
        out = stock_rope(x, cos, sin, *args, **kwargs)
        calls.append(((x, cos, sin), out))
        return out

    monkeypatch.setattr(hf, "apply_rotary_pos_emb", recording_rope)
    seen = {}

    def before_attention(module, args, kwargs):
        seen[module.layer_idx] = {"hidden": args[0], "tables": kwargs["position_embeddings"],
                                  "first_call": len(calls)}

    def after_attention(module, args, kwargs, output):
        seen[module.layer_idx]["last_call"] = len(calls) - 1

    def after_q_norm(module, args, output):
        seen[module.layer_idx]["q_residual"] = output

    handles = []
    for layer in model.model.layers:
        attn = layer.self_attn
        handles += [attn.register_forward_pre_hook(before_attention, with_kwargs=True),
                    attn.register_forward_hook(after_attention, with_kwargs=True),
                    attn.q_a_norm.register_forward_hook(after_q_norm)]
        attn.q_a_norm.layer_idx = attn.layer_idx
    try:
        with torch.no_grad():
            model(torch.randint(2, config.vocab_size, (2, 19)), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()

    assert sorted(seen) == [0, 1, 2]
    for layer in model.model.layers:
        attn, got = layer.self_attn, seen[layer.self_attn.layer_idx]
        cos, sin = got["tables"][attn.rope_layer_type]
        stock_q, stock_kv = calls[got["first_call"]][1], calls[got["first_call"] + 1][1]  # [B, H, S, D], [B, 1, S, D]
        with torch.no_grad():
            q, q_residual = torch.ops.mla.shared_kv_q_prolog(
                got["hidden"], attn.q_a_proj.weight, attn.q_a_norm.weight, attn.q_b_proj.weight, cos, sin,
                num_heads=config.num_attention_heads, eps=config.rms_norm_eps)
            kv = torch.ops.mla.shared_kv_prolog(got["hidden"], attn.kv_proj.weight, attn.kv_norm.weight, cos, sin,
                                                eps=config.rms_norm_eps)
        assert q.dtype == kv.dtype == q_residual.dtype == dtype
        assert q.is_contiguous() and kv.is_contiguous() and q_residual.is_contiguous()
        assert torch.equal(q, stock_q.transpose(1, 2)), f"layer {attn.layer_idx}: q"
        assert torch.equal(q_residual, got["q_residual"]), f"layer {attn.layer_idx}: q_residual"
        assert torch.equal(kv, stock_kv[:, 0]), f"layer {attn.layer_idx}: kv"
        # the attention's last rope call undoes the rotation of its output: mla.rope with -sin on the trailing R
        (out, inv_cos, inv_sin), stock_out = calls[got["last_call"]]
        assert torch.equal(inv_sin, -sin)
        ours = torch.ops.mla.rope(out[..., -rope_dim:], cos, -sin, compute_dtype=_inverse_rope_rounding(dtype))
        assert torch.equal(torch.cat([out[..., :-rope_dim], ours], dim=-1), stock_out), f"layer {attn.layer_idx}"


def _inverse_rope_rounding(dtype: torch.dtype) -> str:
    """The mla.rope compute_dtype that is bit-identical to V4's fp32 rope formula: in bf16 / fp16 the products
    of the inputs are exact in fp32, so "float32"'s complex multiplication cannot round differently; in fp32
    "activation" is the very formula, while "float32"'s fused multiply-adds may differ by an ulp."""
    return "activation" if dtype == torch.float32 else "float32"


@pytest.mark.parametrize("rope_dim", ROPE_DIMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 4, 37), (2, 64, 37), (1, 8, 100)])
def test_inverse_rope_bit_identical_to_stock(dtype, rope_dim, shape):
    """`mla.rope(x[..., -R:], cos, -sin)` is stock's `apply_rotary_pos_emb(x, cos, -sin)` on the trailing R
    channels, with tables rounded to the model dtype as stock's rotary embedding returns them."""
    batch, heads, seq = shape
    x = (3 * torch.randn(batch, heads, seq, 2 * rope_dim)).to(dtype)
    freqs = torch.randint(0, 1 << 17, (batch, seq))[..., None].float() * (
        1.0 / 160000 ** (torch.arange(0, rope_dim, 2).float() / rope_dim))
    cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
    want = hf.apply_rotary_pos_emb(x, cos, -sin)
    got = torch.ops.mla.rope(x[..., -rope_dim:], cos, -sin, compute_dtype=_inverse_rope_rounding(dtype))
    assert torch.equal(torch.cat([x[..., :-rope_dim], got], dim=-1), want)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_prologs_take_shared_tables_and_fp32_or_activation_norm_weights(dtype):
    """cos / sin `[S, R/2]` (shared by the batch) equal the same tables expanded to `[B, S, R/2]`; a norm weight
    in the activation dtype (a model cast with `.to(dtype)`) gives what the stock norm with that weight gives."""
    config, model = _model(8, dtype)
    attn = _attention(model, CSA)
    hidden = torch.randn(3, 5, config.hidden_size).to(dtype)
    freqs = torch.arange(5)[:, None].float() * torch.rand(4)
    cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
    with torch.no_grad():
        shared = torch.ops.mla.shared_kv_q_prolog(hidden, attn.q_a_proj.weight, attn.q_a_norm.weight,
                                                  attn.q_b_proj.weight, cos, sin, num_heads=4)
        batched = torch.ops.mla.shared_kv_q_prolog(hidden, attn.q_a_proj.weight, attn.q_a_norm.weight,
                                                   attn.q_b_proj.weight, cos.expand(3, 5, 4), sin.expand(3, 5, 4),
                                                   num_heads=4)
        assert all(torch.equal(a, b) for a, b in zip(shared, batched))
        cast_norm = copy.deepcopy(attn.kv_norm).to(dtype)
        kv = torch.ops.mla.shared_kv_prolog(hidden, attn.kv_proj.weight, cast_norm.weight, cos, sin)
        stock = hf.apply_rotary_pos_emb(cast_norm(attn.kv_proj(hidden)).unsqueeze(1), cos[None].expand(3, 5, 4),
                                        sin[None].expand(3, 5, 4))[:, 0]
    assert cast_norm.weight.dtype == dtype
    assert torch.equal(kv, stock)


# --------------------------------------------------------------------------------------- compressor
# Two requests, one op call per step (a request with 0 new tokens sits the step out): request 0 is
# prefilled in one shot, request 1 in chunks that are no multiple of m (and one empty), then both
# decode one token per step, closing windows on the way.
SCHEDULE = [(37, 5), (1, 7), (1, 0), (0, 3), (1, 6)] + [(1, 1)] * 14
BLOCK_SIZE = 3
SENTINEL = 7.0


class _Paged:
    """The op's side: one paged entry pool and one state per compressor, shuffled block tables."""

    def __init__(self, head_dim, channels, compress_ratio, overlap, dtype, max_entries, batch=2):
        blocks_per_request = -(-max_entries // BLOCK_SIZE)
        num_blocks = batch * blocks_per_request + 3
        self.pool = torch.full((num_blocks, BLOCK_SIZE, 1, head_dim), SENTINEL, dtype=dtype)
        rows = 2 * compress_ratio if overlap else compress_ratio
        self.state = torch.full((batch, rows, 2, channels), float("nan"), dtype=dtype)  # any start works
        order = torch.randperm(num_blocks)[: batch * blocks_per_request].to(torch.int32)
        self.tables = order.view(batch, blocks_per_request)

    def entries(self, request: int, count: int) -> torch.Tensor:
        index = torch.arange(count)
        return self.pool[self.tables[request, index // BLOCK_SIZE].long(), index % BLOCK_SIZE, 0]

    def untouched_beyond(self, counts) -> bool:
        """Every slot that holds no entry of a request still holds the sentinel."""
        held = torch.zeros(self.pool.shape[:2], dtype=torch.bool)
        for request, count in enumerate(counts):
            index = torch.arange(count)
            held[self.tables[request, index // BLOCK_SIZE].long(), index % BLOCK_SIZE] = True
        return bool((self.pool[~held] == SENTINEL).all())


def _rope_cache(module, dtype, positions=64):
    cos, sin = module.rotary_emb(torch.empty(0, dtype=dtype), position_ids=torch.arange(positions)[None],
                                 layer_type=module.rope_layer_type)
    return cos[0], sin[0]


def _compressors(model, layer_type):
    """(stock module, the cache's name for its entries, overlap) of each compressor of the layer type."""
    compressor = _attention(model, layer_type).compressor
    if layer_type == HCA:
        return [(compressor, "compressor", False)]
    return [(compressor, "compressor", True), (compressor.indexer, "indexer", True)]


@pytest.mark.parametrize("rope_dim", ROPE_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("layer_type", [CSA, HCA], ids=["csa", "hca"])
def test_compressor_entries_bit_identical_to_stock_cache(dtype, rope_dim, layer_type):
    """After every step, each request's entries in the pool are the stock cache's `compressed_kv` (the
    attention compressor at head_dim and, for CSA, the indexer's at index_head_dim), and no other slot
    was written."""
    config, model = _model(rope_dim, dtype)
    layer_idx = _attention(model, layer_type).layer_idx
    batch = 2
    total = [sum(step[b] for step in SCHEDULE) for b in range(batch)]
    stock_caches = [DynamicCache(config=config) for _ in range(batch)]
    assert type(stock_caches[0].layers[layer_idx]).__name__ == ("DeepseekV4CSACache" if layer_type == CSA
                                                                 else "DeepseekV4HCACache")
    ours = {}
    for module, name, overlap in _compressors(model, layer_type):
        head_dim, m = module.head_dim, module.compress_rate
        assert min(total) // m >= 2  # every request closes windows in prefill and in decode
        ours[name] = _Paged(head_dim, 2 * head_dim if overlap else head_dim, m, overlap, dtype, max(total) // m)
    hidden = [torch.randn(1, n, config.hidden_size).to(dtype) for n in total]
    q_residual = [torch.randn(1, n, config.q_lora_rank).to(dtype) for n in total]
    done = [0] * batch
    for step in SCHEDULE:
        with torch.no_grad():
            for b, count in enumerate(step):  # stock: one request per forward
                if count:
                    span = slice(done[b], done[b] + count)
                    _attention(model, layer_type).compressor(
                        hidden[b][:, span], q_residual[b][:, span], torch.arange(done[b], done[b] + count)[None],
                        stock_caches[b], layer_idx)
            seq_lens = torch.tensor([done[b] + step[b] for b in range(batch)], dtype=torch.int32)
            query_start_loc = torch.tensor([0, step[0], step[0] + step[1]], dtype=torch.int32)
            for module, name, overlap in _compressors(model, layer_type):
                rows = [module.kv_proj(hidden[b][:, done[b]:done[b] + step[b]])[0] for b in range(batch)]
                gates = [module.gate_proj(hidden[b][:, done[b]:done[b] + step[b]])[0] for b in range(batch)]
                cos, sin = _rope_cache(module, dtype)
                paged = ours[name]
                torch.ops.mla.kv_compressor(
                    torch.cat(rows), torch.cat(gates), module.position_bias, module.kv_norm.weight, cos, sin,
                    paged.state, paged.pool, paged.tables, seq_lens, query_start_loc,
                    compress_ratio=module.compress_rate, overlap=overlap, eps=config.rms_norm_eps)
                counts = []
                for b in range(batch):
                    stock = stock_caches[b].layers[layer_idx].compressed_kv[name]
                    count = stock_caches[b].layers[layer_idx].entry_count[name]
                    assert count == int(seq_lens[b]) // module.compress_rate
                    if count:
                        assert torch.equal(paged.entries(b, count), stock[0]), f"{name}, request {b}, step {step}"
                    counts.append(count)
                assert paged.untouched_beyond(counts), f"{name}: a slot without an entry was written"
        done = [done[b] + step[b] for b in range(batch)]


def _compressor_inputs(dtype=torch.float32, overlap=True, head_dim=16, rope_dim=8, m=4, lens=((9, 9), (6, 2))):
    """Random inputs of one call: requests of (seq_len, new tokens), a state of random rows (what earlier
    calls wrote), a pool holding the sentinel."""
    channels = 2 * head_dim if overlap else head_dim
    seq_lens = torch.tensor([n for n, _ in lens], dtype=torch.int32)
    query_start_loc = torch.tensor([0] + list(torch.tensor([q for _, q in lens]).cumsum(0)), dtype=torch.int32)
    tokens = int(query_start_loc[-1])
    entries = max(n // m for n, _ in lens)
    paged = _Paged(head_dim, channels, m, overlap, dtype, max(entries, 1), batch=len(lens))
    paged.state.normal_()
    cos_sin = torch.randn(2, 64, rope_dim // 2).to(dtype)
    args = (torch.randn(tokens, channels).to(dtype), torch.randn(tokens, channels).to(dtype),
            torch.randn(m, channels), 1 + 0.1 * torch.randn(head_dim), cos_sin[0], cos_sin[1], paged.state,
            paged.pool, paged.tables, seq_lens, query_start_loc)
    return args, {"compress_ratio": m, "overlap": overlap, "eps": 1e-6}


@pytest.mark.parametrize("overlap", [True, False], ids=["csa", "hca"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_compressor_device_path_matches_checked_path(dtype, overlap):
    """The sync-free path (a static bound of candidate windows of all requests in one tensor, the unused
    ones masked) writes the same entries and state as the CPU path (the counted windows, one request at a
    time); both leave the other slots alone. Bit for bit on one thread: with more, ATen may split the
    softmax of the two tensor shapes differently."""
    args, kwargs = _compressor_inputs(dtype, overlap, lens=((9, 9), (6, 2), (13, 1), (3, 3)))
    args_free = tuple(a.clone() for a in args)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.ops.mla.kv_compressor(*args, **kwargs)
        kv_compressor_sync_free(*args_free, kwargs["compress_ratio"], kwargs["overlap"], kwargs["eps"])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(args[6], args_free[6]) and torch.equal(args[7], args_free[7])
    assert not torch.equal(args[7], torch.full_like(args[7], SENTINEL))


def test_compressor_device_path_skips_what_it_cannot_address():
    """Bad values on the unchecked path write nothing out of bounds: an entry whose block id is outside
    the pool, or whose rope position is past the tables, is not written; every other entry and the state
    are what the checked path writes for good values."""
    args, kwargs = _compressor_inputs(lens=((9, 9), (8, 3)))  # request 0 closes entries 0, 1; request 1 entry 1
    m, overlap, eps = kwargs["compress_ratio"], kwargs["overlap"], kwargs["eps"]
    good = tuple(a.clone() for a in args)
    torch.ops.mla.kv_compressor(*good, **kwargs)
    block_0, block_1 = int(args[8][0, 0]), int(args[8][1, 0])

    outside = tuple(a.clone() for a in args)
    outside[8][0, 0] = outside[7].shape[0]  # request 0's first block: past the pool
    kv_compressor_sync_free(*outside, m, overlap, eps)
    want = good[7].clone()
    want[block_0] = SENTINEL
    assert torch.equal(outside[7], want) and torch.equal(outside[6], good[6])

    short = tuple(a.clone() for a in args)
    short = short[:4] + (short[4][:4], short[5][:4]) + short[6:]  # positions 0..3: entry 1 (position 4) is past them
    kv_compressor_sync_free(*short, m, overlap, eps)
    want = good[7].clone()
    want[block_0, 1] = want[block_1, 1] = SENTINEL
    assert torch.equal(short[7], want) and torch.equal(short[6], good[6])
    assert not (want[block_0, 0] == SENTINEL).all()


# ------------------------------------------------------------------------------------------- errors
def _prolog_inputs(dtype=torch.float32):
    hidden = torch.randn(2, 5, 64).to(dtype)
    cos, sin = torch.randn(2, 5, 4).to(dtype), torch.randn(2, 5, 4).to(dtype)
    q_args = [hidden, torch.randn(32, 64).to(dtype), torch.ones(32), torch.randn(4 * 32, 32).to(dtype), cos, sin]
    kv_args = [hidden, torch.randn(32, 64).to(dtype), torch.ones(32), cos, sin]
    return q_args, {"num_heads": 4}, kv_args, {}


def _replaced(args, where, values):
    """args with args[where] = values, or args[i] = values[k] for the k-th index i of a tuple `where`."""
    changes = dict(zip(where, values)) if isinstance(where, tuple) else {where: values}
    return [changes.get(i, a) for i, a in enumerate(args)]


Q_ERRORS = [  # (argument index or kwarg, bad value factory, argument named, message part); a tuple of indices
    # takes one bad value for each
    (0, lambda a: a[0][0], "hidden_states", "3-D"),
    (1, lambda a: a[1].to(torch.float16), "q_a_weight", "dtype"),
    (1, lambda a: a[1][:, :63], "q_a_weight", "in_features"),
    (2, lambda a: a[2][:31], "q_norm_weight", "q_lora_rank"),
    (2, lambda a: a[2].to(torch.float16), "q_norm_weight", "float32"),
    (3, lambda a: a[3][:, :31], "q_b_weight", "q_lora_rank"),
    (3, lambda a: a[3][:127], "q_b_weight", "num_heads"),
    ((4, 5), lambda a: (torch.randn(3, 5, 4),) * 2, "cos", "batch dim must be 1 or 2"),
    (4, lambda a: torch.randn(2, 5, 17), "cos", "must not exceed"),
    (5, lambda a: a[5][:, :4], "sin", "same shape"),
    ("num_heads", lambda a: 0, "num_heads", "positive"),
    ("eps", lambda a: -1.0, "eps", ">= 0"),
]


@pytest.mark.parametrize("where,bad,argument,message", Q_ERRORS, ids=[f"{e[2]}-{e[3]}" for e in Q_ERRORS])
def test_q_prolog_bad_arguments(where, bad, argument, message):
    args, kwargs, _, _ = _prolog_inputs()
    if isinstance(where, str):
        kwargs = {**kwargs, where: bad(args)}
    else:
        args = _replaced(args, where, bad(args))
    with pytest.raises(RuntimeError, match=rf"mla\.shared_kv_q_prolog: .*{argument}.*{message}|"
                                           rf"mla\.shared_kv_q_prolog: .*{message}.*{argument}"):
        torch.ops.mla.shared_kv_q_prolog(*args, **kwargs)


KV_ERRORS = [
    (0, lambda a: a[0].to(torch.int32), "hidden_states", "float32, float16 or bfloat16"),
    (1, lambda a: a[1][:, :60], "kv_weight", "in_features"),
    (2, lambda a: a[2][:30], "kv_norm_weight", "head_dim"),
    ((3, 4), lambda a: (a[3][:, :4], a[4][:, :4]), "cos", "sequence dim"),
    (3, lambda a: a[3][..., :0], "cos", "no rotation pair"),
    (4, lambda a: a[4].to(torch.int64), "sin", "float32"),
]


@pytest.mark.parametrize("where,bad,argument,message", KV_ERRORS, ids=[f"{e[2]}-{e[3]}" for e in KV_ERRORS])
def test_kv_prolog_bad_arguments(where, bad, argument, message):
    _, _, args, kwargs = _prolog_inputs()
    args = _replaced(args, where, bad(args))
    with pytest.raises(RuntimeError, match=rf"mla\.shared_kv_prolog: .*{argument}"):
        torch.ops.mla.shared_kv_prolog(*args, **kwargs)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.mla.shared_kv_prolog(*args, **kwargs)


COMPRESSOR_ERRORS = [  # metadata (RuntimeError)
    (0, lambda a: a[0][:, :16], "kv", "2 \\* head_dim"),
    (1, lambda a: a[1][:-1], "gate", "tokens"),
    (1, lambda a: a[1].to(torch.bfloat16), "gate", "dtype"),
    (2, lambda a: a[2][:3], "position_bias", "compress_ratio"),
    (2, lambda a: a[2].to(torch.float16), "position_bias", "float32"),
    (3, lambda a: a[3].to(torch.float16), "norm_weight", "float32"),
    ((4, 5), lambda a: (torch.randn(64, 9),) * 2, "cos_cache", "must not exceed"),
    (5, lambda a: a[5][:3], "sin_cache", "same shape"),
    (6, lambda a: a[6][:, :4], "state", "2 \\* compress_ratio"),
    (6, lambda a: a[6][:1], "state", "block-table rows"),
    (6, lambda a: a[6].to(torch.bfloat16), "state", "dtype"),
    (6, lambda a: a[6][:, :, :1].expand(-1, -1, 2, -1), "state", "overlapping memory"),
    (7, lambda a: a[7][..., :8], "entry_cache", "head_dim"),
    (8, lambda a: a[8].float(), "block_tables", "int32 or int64"),
    (10, lambda a: a[10][:2], "query_start_loc", "one entry per request"),
    ("compress_ratio", lambda a: 0, "compress_ratio", ">= 1"),
]


@pytest.mark.parametrize("where,bad,argument,message", COMPRESSOR_ERRORS,
                         ids=[f"{e[2]}-{e[3]}" for e in COMPRESSOR_ERRORS])
def test_compressor_bad_arguments(where, bad, argument, message):
    args, kwargs = _compressor_inputs()
    if isinstance(where, str):
        kwargs = {**kwargs, where: bad(args)}
    else:
        args = _replaced(args, where, bad(args))
    with pytest.raises(RuntimeError, match=rf"mla\.kv_compressor: {argument}.*{message}|"
                                           rf"mla\.kv_compressor: .*{argument}.*{message}"):
        torch.ops.mla.kv_compressor(*args, **kwargs)


COMPRESSOR_VALUE_ERRORS = [  # (lens, change of the request tensors, message); CPU checks before writing
    (lambda a: a[10].copy_(torch.tensor([0, 9, 10])), r"query_start_loc\[-1\] = 10 must equal"),
    (lambda a: a[9].copy_(torch.tensor([9, 1])), r"seq_lens\[1\] = 1 is less than the request's 2 new tokens"),
    (lambda a: a[8].fill_(-1), r"block_tables\[0, 0\] = -1 holds entries this call writes"),
    (lambda a: a[9].copy_(torch.tensor([9, 32])), r"seq_lens\[1\] = 32 closes entry 7 .* capacity"),
]


@pytest.mark.parametrize("change,message", COMPRESSOR_VALUE_ERRORS, ids=["starts", "seq_lens", "block", "capacity"])
def test_compressor_bad_values_write_nothing(change, message):
    args, kwargs = _compressor_inputs()
    change(args)
    state, pool = args[6].clone(), args[7].clone()
    with pytest.raises(ValueError, match=rf"mla\.kv_compressor: {message}"):
        torch.ops.mla.kv_compressor(*args, **kwargs)
    assert torch.equal(args[6], state) and torch.equal(args[7], pool)


def test_compressor_rope_positions_past_the_tables():
    args, kwargs = _compressor_inputs()
    args = args[:4] + (args[4][:4], args[5][:4]) + args[6:]  # entry 1 of request 0 is rotated at position 4
    pool = args[7].clone()
    with pytest.raises(ValueError, match=r"mla\.kv_compressor: entry 1 of request 0 is rotated at position 4, but "
                                         r"cos_cache / sin_cache hold positions 0..3"):
        torch.ops.mla.kv_compressor(*args, **kwargs)
    assert torch.equal(args[7], pool)


# ------------------------------------------------------------------------------ opcheck and compile
def _op_calls():
    q_args, q_kwargs, kv_args, kv_kwargs = _prolog_inputs()
    csa, csa_kwargs = _compressor_inputs(overlap=True)
    hca, hca_kwargs = _compressor_inputs(overlap=False, m=8, lens=((17, 17), (9, 3)))
    return {"q": (torch.ops.mla.shared_kv_q_prolog.default, tuple(q_args), q_kwargs),
            "kv": (torch.ops.mla.shared_kv_prolog.default, tuple(kv_args), kv_kwargs),
            "csa": (torch.ops.mla.kv_compressor.default, csa, csa_kwargs),
            "hca": (torch.ops.mla.kv_compressor.default, hca, hca_kwargs)}


@pytest.mark.parametrize("which", ["q", "kv", "csa", "hca"])
def test_opcheck(which):
    op, args, kwargs = _op_calls()[which]
    opcheck(op, args, kwargs)


@pytest.mark.parametrize("which", ["q", "kv", "csa", "hca"])
def test_compiles_to_one_node(which):
    """torch.compile(fullgraph=True): one graph, the op as one node, outputs (and written tensors) as eager."""
    op, args, kwargs = _op_calls()[which]
    written = [i for i, a in enumerate(op._schema.arguments) if a.alias_info and a.alias_info.is_write]

    def call(*tensors):
        tensors = [t.clone() if i in written else t for i, t in enumerate(tensors)]
        out = op(*tensors, **kwargs)
        outputs = () if out is None else tuple(out) if isinstance(out, (tuple, list)) else (out,)
        return outputs + tuple(tensors[i] for i in written)

    torch._dynamo.reset()
    capture = GraphCapture()
    got = torch.compile(call, backend=capture, fullgraph=True)(*args)
    assert len(capture.graphs) == 1
    nodes = [n for gm in capture.graphs for n in gm.graph.nodes if n.op == "call_function"]
    assert sum(n.target in (op, op.overloadpacket) for n in nodes) == 1, [str(n.target) for n in nodes]
    for g, w in zip(got, call(*args)):
        assert torch.equal(g, w)


@pytest.mark.parametrize("which", ["q", "kv", "csa"])
def test_inference_only(which):
    op, args, kwargs = _op_calls()[which]
    args = list(args)
    args[0] = args[0].clone().requires_grad_(True)
    with pytest.raises(RuntimeError, match=rf"mla\.{op.overloadpacket.__name__} is inference-only.*no_grad"):
        op(*args, **kwargs)
