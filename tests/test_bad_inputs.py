"""Bad-input matrix: every paged-cache constraint of the design document and wrong rank / dtype / device / size on
every op gives an error naming the argument; sync-free checks fail the same way eagerly and under
torch.compile; outputs are untouched after a rejected call; out-of-range ids never touch memory out
of bounds."""
import re

import pytest
import torch

import mla_ops
from mla_ops.ops.gather_pa_kv_cache import gather_sync_free
from mla_ops.ops.scatter_pa_kv_cache import scatter_sync_free

from utils import SMALL, paged_case, prolog_inputs, prolog_kwargs, rope_tables

d = SMALL


def _prolog_args(**changes):
    names = ("hidden_states", "kv_a_weight", "kv_a_bias", "kv_norm_weight", "kv_b_weight", "cos", "sin")
    args = dict(zip(names, prolog_inputs(d, torch.float32, bias=True)))
    args.update(changes)
    return args


def _gather_args(**changes):
    kc, vc, tables, cumsum, offsets = paged_case(10, 4, [5, 3], key_shape=(1, 8), value_shape=(1, 4),
                                                 dtype=torch.float32, offsets=[4, 0], columns=4)
    args = dict(key_cache=kc, value_cache=vc, block_tables=tables, seq_lens=cumsum,
                key=torch.full((8, 1, 8), 3.0), value=torch.full((8, 1, 4), 3.0), seq_offset=offsets,
                is_seq_lens_cumsum=True)
    args.update(changes)
    return args


def _scatter_args(**changes):
    kc, vc, *_ = paged_case(4, 4, [3], key_shape=(1, 8), value_shape=(1, 4), dtype=torch.float32)
    args = dict(key=torch.randn(3, 1, 8), value=torch.randn(3, 1, 4), key_cache=kc, value_cache=vc,
                slot_mapping=torch.tensor([0, 5, -1]))
    args.update(changes)
    return args


def _decode_args(**changes):
    kc, vc, tables, _, _ = paged_case(6, 4, [5, 3], key_shape=(1, 8), value_shape=(1, 4), dtype=torch.float32)
    args = dict(q_latent=torch.randn(2, 3, 8), q_pe=torch.randn(2, 3, 4), key_cache=kc, value_cache=vc,
                block_tables=tables, seq_lens=torch.tensor([5, 3]), softmax_scale=0.5)
    args.update(changes)
    return args


def _call(op, args):
    args = dict(args)
    if op == "kv_prolog":
        return mla_ops.kv_prolog(*args.values(), **prolog_kwargs(d))
    if op == "rms_norm":
        return torch.ops.mla.rms_norm(args["x"], args["weight"], args.get("eps", 1e-6))
    if op == "rope":
        return torch.ops.mla.rope(args["x"], args["cos"], args["sin"], layout=args.get("layout", "interleaved"))
    if op == "gather":
        kw = {k: args.pop(k) for k in ("seq_offset", "is_seq_lens_cumsum")}
        return torch.ops.mla.gather_pa_kv_cache(*args.values(), **kw)
    if op == "scatter":
        return torch.ops.mla.scatter_pa_kv_cache(*args.values())
    if op == "decode":
        return torch.ops.mla.mla_decode_attention(*args.values())
    raise AssertionError(op)


x3 = torch.randn(2, 3, 16)
cos, sin = rope_tables(2, 3, 8)
hidden = prolog_inputs(d, torch.float32)[0]

# (op, args, message regex): each message names the op and the argument.
SYNC_FREE_CASES = [
    ("rms_norm", dict(x=x3, weight=torch.randn(15)), r"rms_norm: weight length must equal the last dim of x"),
    ("rms_norm", dict(x=x3, weight=torch.randn(4, 4)), r"rms_norm: weight must be 1-D"),
    ("rms_norm", dict(x=x3.int(), weight=torch.randn(16)), r"rms_norm: x must be float32, float16 or bfloat16"),
    ("rms_norm", dict(x=x3, weight=torch.randn(16, device="meta")), r"rms_norm: all tensors must be on one device"),
    ("rms_norm", dict(x=x3, weight=torch.randn(16), eps=-1.0), r"rms_norm: eps must be >= 0"),
    ("rope", dict(x=torch.randn(2, 4, 3, 7), cos=cos, sin=sin), r"rope: the rotary dim of x must be even"),
    ("rope", dict(x=torch.randn(2, 4, 3, 8), cos=cos, sin=sin, layout="gptj"), r"rope: layout must be one of"),
    ("rope", dict(x=torch.randn(2, 4, 5, 8), cos=cos, sin=sin), r"rope: cos sequence dim must equal"),
    ("rope", dict(x=torch.randn(3, 4, 3, 8), cos=cos, sin=sin), r"rope: cos batch dim must be 1 or 3"),
    ("rope", dict(x=torch.randn(2, 4, 3, 8), cos=cos, sin=sin[..., :2]), r"rope: cos and sin must have the same"),
    ("rope", dict(x=torch.randn(2, 4, 3, 8), cos=cos.int(), sin=sin), r"rope: cos must be float32"),
    ("kv_prolog", _prolog_args(hidden_states=hidden[0]), r"kv_prolog: hidden_states must be 3-D"),
    ("kv_prolog", _prolog_args(kv_a_weight=torch.randn(d.L + d.R, d.H + 1)),
     r"kv_prolog: kv_a_weight in_features .* must equal the hidden size"),
    ("kv_prolog", _prolog_args(kv_norm_weight=torch.randn(d.L + d.R)), r"kv_prolog: kv_a_weight has .* output rows"),
    ("kv_prolog", _prolog_args(kv_norm_weight=torch.randn(d.L + 1)),
     rf"kv_prolog: kv_norm_weight has {d.L + 1} entries, .* leave kv_lora_rank = {d.L}"),
    ("kv_prolog", _prolog_args(kv_b_weight=torch.randn(d.N * (d.P + d.V) + 1, d.L)),
     r"kv_prolog: kv_b_weight rows must be num_heads \* \(qk_nope_head_dim \+ v_head_dim\)"),
    ("kv_prolog", _prolog_args(kv_b_weight=torch.randn(d.N * (d.P + d.V), d.L).half()),
     r"kv_prolog: kv_b_weight has dtype torch.float16 but hidden_states has torch.float32"),
    ("kv_prolog", _prolog_args(kv_a_bias=torch.randn(3)), r"kv_prolog: kv_a_bias length must equal"),
    ("kv_prolog", _prolog_args(cos=torch.randn(d.B, d.S, 3), sin=torch.randn(d.B, d.S, 3)),
     r"kv_prolog: cos last dim must be half the rotary dim of k_pe"),
    ("kv_prolog", _prolog_args(cos=torch.randn(d.B, d.S, d.R // 2, device="meta")),
     r"kv_prolog: all tensors must be on one device"),
    ("gather", _gather_args(key_cache=torch.randn(10, 4, 8)), r"gather_pa_kv_cache: key_cache must be 4-D"),
    ("gather", _gather_args(value_cache=torch.randn(9, 4, 1, 4)),
     r"gather_pa_kv_cache: value_cache num_blocks .* must equal key_cache's"),
    ("gather", _gather_args(value_cache=torch.randn(10, 2, 1, 4)),
     r"gather_pa_kv_cache: value_cache block_size .* must equal key_cache's"),
    ("gather", _gather_args(key=torch.zeros(8, 1, 7)), r"gather_pa_kv_cache: key head dim .* must equal key_cache"),
    ("gather", _gather_args(key=torch.zeros(8, 2, 8)), r"gather_pa_kv_cache: key heads .* must equal key_cache"),
    ("gather", _gather_args(key=torch.zeros(8, 1, 8, dtype=torch.float16)),
     r"gather_pa_kv_cache: key has dtype torch.float16 but key_cache"),
    ("gather", _gather_args(block_tables=torch.zeros(2, 4)), r"gather_pa_kv_cache: block_tables must be an int32"),
    ("gather", _gather_args(seq_lens=torch.tensor([0, 5])),
     r"gather_pa_kv_cache: seq_lens must have num_seqs \+ 1 entries"),
    ("gather", _gather_args(is_seq_lens_cumsum=False), r"gather_pa_kv_cache: seq_lens must have one length per"),
    ("gather", _gather_args(seq_offset=torch.tensor([0.0, 4.0])), r"gather_pa_kv_cache: seq_offset must be an int"),
    ("gather", _gather_args(seq_offset=torch.tensor([0])), r"gather_pa_kv_cache: seq_offset needs one offset per"),
    # an expanded (stride-0) output or cache: rejected before anything is written
    ("gather", _gather_args(value=torch.full((1, 1, 4), 3.0).expand(8, 1, 4)),
     r"gather_pa_kv_cache: value has overlapping memory .* stride-0"),
    ("gather", _gather_args(key=torch.full((8, 1, 1), 3.0).expand(8, 1, 8)),
     r"gather_pa_kv_cache: key has overlapping memory"),
    ("scatter", _scatter_args(key_cache=torch.zeros(1, 4, 1, 8).expand(4, 4, 1, 8)),
     r"scatter_pa_kv_cache: key_cache has overlapping memory"),
    ("scatter", _scatter_args(value_cache=torch.zeros(4, 1, 1, 4).expand(4, 4, 1, 4)),
     r"scatter_pa_kv_cache: value_cache has overlapping memory"),
    ("scatter", _scatter_args(slot_mapping=torch.tensor([0, 1])),
     r"scatter_pa_kv_cache: slot_mapping length must equal the token count of key"),
    ("scatter", _scatter_args(slot_mapping=torch.tensor([0.0, 1.0, 2.0])),
     r"scatter_pa_kv_cache: slot_mapping must be an int32 or int64"),
    ("scatter", _scatter_args(value=torch.randn(2, 1, 4)), r"scatter_pa_kv_cache: value token count"),
    ("scatter", _scatter_args(key=torch.randn(3, 8)), r"scatter_pa_kv_cache: key must be 3-D"),
    ("decode", _decode_args(key_cache=torch.randn(6, 4, 2, 8)), r"mla_decode_attention: key_cache heads .* must be 1"),
    ("decode", _decode_args(q_pe=torch.randn(2, 3, 5)),
     r"mla_decode_attention: value_cache dim .* must equal rope_dim"),
    ("decode", _decode_args(seq_lens=torch.tensor([5])),
     r"mla_decode_attention: seq_lens length must equal the batch"),
    ("decode", _decode_args(q_pe=torch.randn(2, 3, 4).double()), r"mla_decode_attention: q_pe has dtype"),
    ("decode", _decode_args(softmax_scale=float("nan")),
     r"mla_decode_attention: softmax_scale must be a finite positive"),
    ("decode", _decode_args(softmax_scale=0.0), r"mla_decode_attention: softmax_scale must be a finite positive"),
    ("decode", _decode_args(key_cache=torch.randn(0, 4, 1, 8), value_cache=torch.randn(0, 4, 1, 4)),
     r"mla_decode_attention: key_cache needs at least one block"),
]
case_ids = [f"{op}-{i}" for i, (op, _, _) in enumerate(SYNC_FREE_CASES)]


def _snapshot(args):
    return {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor) and v.device.type != "meta"}


def _assert_untouched(args, snapshot):
    for k, v in snapshot.items():
        assert torch.equal(args[k], v), f"{k} was modified by a rejected call"


@pytest.mark.parametrize("op,args,message", SYNC_FREE_CASES, ids=case_ids)
def test_sync_free_checks_eager(op, args, message):
    snapshot = _snapshot(args)
    with pytest.raises(RuntimeError, match=message):
        _call(op, args)
    _assert_untouched(args, snapshot)


@pytest.mark.parametrize("op,args,message", SYNC_FREE_CASES, ids=case_ids)
def test_sync_free_checks_under_compile(op, args, message):
    """The fake kernel runs the same check function at trace time: same message, and no graph ever
    reaches the backend (so the real kernel, which would raise the same words, never ran)."""
    if any(isinstance(v, torch.Tensor) and v.device.type == "meta" for v in args.values()):
        pytest.skip("a meta tensor mixed with CPU tensors is rejected by Dynamo before any op runs")
    torch._dynamo.reset()
    snapshot = _snapshot(args)
    graphs = []

    def recording_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(lambda a: _call(op, a), backend=recording_backend, fullgraph=True)
    with pytest.raises(Exception, match=message):
        compiled(args)
    assert not graphs, "the error came from running a compiled graph, not from the fake kernel at trace time"
    _assert_untouched(args, snapshot)


VALUE_CASES = [
    ("gather", _gather_args(seq_lens=torch.tensor([1, 5, 8], dtype=torch.int32)),
     r"cumulative seq_lens must start at 0, got seq_lens\[0\] = 1"),
    ("gather", _gather_args(seq_lens=torch.tensor([0, 5, 4], dtype=torch.int32)),
     r"cumulative seq_lens must never decrease, but seq_lens\[2\] = 4 < seq_lens\[1\] = 5"),
    ("gather", _gather_args(seq_lens=torch.tensor([5, -1]), is_seq_lens_cumsum=False),
     r"seq_lens\[1\] = -1 is negative"),
    ("gather", _gather_args(seq_offset=torch.tensor([-4, 0], dtype=torch.int32)), r"seq_offset\[0\] = -4 is negative"),
    ("gather", _gather_args(seq_offset=torch.tensor([2, 0], dtype=torch.int32)),
     r"seq_offset\[0\] = 2 is not a multiple of block_size 4"),
    ("gather", _gather_args(seq_offset=torch.tensor([12, 0], dtype=torch.int32)),
     r"sequence 0 needs block-table columns 3..4 .* but block_tables has only 4 columns"),
    ("gather", _gather_args(block_tables=torch.tensor([[0, 1, 10, 3], [4, 5, 6, 7]], dtype=torch.int32)),
     r"block_tables\[0, 2\] = 10 is used by sequence 0 but is not a block id in \[0, 10\)"),
    ("gather", _gather_args(block_tables=torch.tensor([[0, 1, 2, 3], [-1, 5, 6, 7]], dtype=torch.int32)),
     r"block_tables\[1, 0\] = -1 is used by sequence 1"),
    ("gather", _gather_args(key=torch.zeros(7, 1, 8), value=torch.zeros(7, 1, 4)),
     r"the sequences hold 8 tokens but key/value have only 7 rows"),
    # values near 2**63: checked before any int64 arithmetic could wrap around
    ("gather", _gather_args(seq_offset=torch.tensor([2**63 - 4, 0])),
     r"seq_offset\[0\] = 9223372036854775804 starts at block-table column .* only 4 columns"),
    ("gather", _gather_args(seq_offset=None, is_seq_lens_cumsum=False,
                            block_tables=torch.zeros(2, 4, dtype=torch.int32), seq_lens=torch.tensor([2**62, 2**62])),
     r"sequence 0 needs block-table columns .* seq_lens may hold at most 16 tokens"),
    ("gather", _gather_args(seq_offset=None, is_seq_lens_cumsum=False,
                            block_tables=torch.zeros(3, 4, dtype=torch.int32),
                            seq_lens=torch.tensor([2**62, 2**62, 2**62 - 1])),
     r"sequence 0 needs block-table columns"),
    ("gather", _gather_args(seq_lens=torch.tensor([0, 2**63 - 1, 2**63 - 1])),
     r"sequence 0 needs block-table columns"),
    ("scatter", _scatter_args(slot_mapping=torch.tensor([0, 16, -1])),
     r"slot_mapping\[1\] = 16 is outside the cache \(num_blocks \* block_size = 16 slots\)"),
    ("decode", _decode_args(seq_lens=torch.tensor([5, 0])), r"seq_lens\[1\] = 0; each decoding sequence"),
    ("decode", _decode_args(seq_lens=torch.tensor([5, 9])), r"seq_lens\[1\] = 9 exceeds the block table's capacity"),
    ("decode", _decode_args(block_tables=torch.tensor([[0, 7], [1, 2]], dtype=torch.int32)),
     r"block_tables\[0, 1\] = 7 is used by sequence 0 but is not a block id in \[0, 6\)"),
]


@pytest.mark.parametrize("op,args,message", VALUE_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(VALUE_CASES)])
def test_value_checks_on_cpu(op, args, message):
    snapshot = _snapshot(args)
    with pytest.raises(ValueError, match=message):
        _call(op, args)
    _assert_untouched(args, snapshot)


def test_explicit_validation_helpers_check_values():
    """The Python helpers run the same value checks on request (what non-CPU callers use)."""
    args = _gather_args(block_tables=torch.tensor([[0, 1, 99, 3], [4, 5, 6, 7]], dtype=torch.int32))
    with pytest.raises(ValueError, match=re.escape("block_tables[0, 2] = 99")):
        mla_ops.gather_pa_kv_cache(args["key_cache"], args["value_cache"], args["block_tables"], args["seq_lens"],
                                   seq_offset=args["seq_offset"], is_seq_lens_cumsum=True, validate=True)


@pytest.mark.parametrize("seq_lens,cumsum,message", [
    (torch.tensor([], dtype=torch.int64), True, r"seq_lens is empty, but with is_seq_lens_cumsum=True"),
    (torch.tensor([2**62, 2**62]), False, r"seq_lens adds up to 9223372036854775808 tokens"),
    (torch.tensor([0, 2**63 - 1]), True, r"seq_lens adds up to 9223372036854775807 tokens"),
], ids=["empty-cumsum", "sum-past-int64", "huge-cumsum"])
def test_allocating_gather_helper_names_seq_lens_before_allocating(seq_lens, cumsum, message):
    """The helper sizes its outputs from seq_lens on the host: values no table can address are
    refused there, naming seq_lens, not as an IndexError or a "negative dimension" allocation."""
    kc, vc, *_ = paged_case(4, 4, [3], key_shape=(1, 8), value_shape=(1, 4), dtype=torch.float32)
    tables = torch.zeros(max(seq_lens.shape[0] - int(cumsum), 0), 2, dtype=torch.int32)
    with pytest.raises(ValueError, match=message):
        mla_ops.gather_pa_kv_cache(kc, vc, tables, seq_lens, is_seq_lens_cumsum=cumsum)


def _guarded(shape, fill):
    """A tensor living inside a larger buffer with sentinel regions before and after it."""
    numel = torch.Size(shape).numel()
    buf = torch.full((numel + 64,), fill, dtype=torch.float32)
    return buf, buf[32:32 + numel].view(shape)


def test_device_paths_never_touch_memory_out_of_bounds():
    """Invalid ids on the sync-free path: nothing outside the caches/outputs changes, out-of-range
    gathered rows read as zeros, out-of-range slots are skipped."""
    kbuf, key_cache = _guarded((4, 2, 1, 3), -5.0)
    vbuf, value_cache = _guarded((4, 2, 1, 2), -5.0)
    key_cache.normal_(), value_cache.normal_()
    before = kbuf.clone(), vbuf.clone()
    scatter_sync_free(torch.randn(4, 1, 3), torch.randn(4, 1, 2), key_cache, value_cache,
                           torch.tensor([8, 10**6, -3, 2**40]))
    assert torch.equal(kbuf[:32], before[0][:32]) and torch.equal(kbuf[-32:], before[0][-32:])
    assert torch.equal(vbuf[:32], before[1][:32]) and torch.equal(vbuf[-32:], before[1][-32:])
    okbuf, key = _guarded((5, 1, 3), 9.0)
    ovbuf, value = _guarded((5, 1, 2), 9.0)
    tables = torch.tensor([[1, 77], [-9, 2]], dtype=torch.int32)
    gather_sync_free(key_cache, value_cache, tables, torch.tensor([4, 1]), key, value, torch.tensor([0, 2**30]),
                          False)
    assert (okbuf[:32] == 9).all() and (okbuf[-32:] == 9).all()
    assert (ovbuf[:32] == 9).all() and (ovbuf[-32:] == 9).all()
    assert torch.equal(key[:2], key_cache[1].view(2, 1, 3))  # valid block 1
    assert torch.equal(value[:2], value_cache[1].view(2, 1, 2))
    assert not key[2:].any() and not value[2:].any(), "rows of invalid blocks / columns are written as zeros"
