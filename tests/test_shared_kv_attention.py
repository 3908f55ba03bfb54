"""mla.shared_kv_attention against DeepSeek-V4 as transformers (5.24) computes it, and against itself.

The stock side is the model's own attention: a tiny `DeepseekV4ForCausalLM` with a sliding-window,
a compressed-sparse (CSA, m = 4) and a heavily-compressed (HCA, m = 8) layer runs prefill, chunked
prefill and decode through its `DynamicCache`, and every call of the module-level
`eager_attention_forward` of `transformers.models.deepseek_v4.modeling_deepseek_v4` is recorded: its
q, its keys (window rows, then compressed entries), its mask (the sliding-window mask and the
compressor's block bias), the layer's sinks and its output. The same q, rows and entries go into
paged pools (block size 3, not dividing the window of 8; entry blocks of 2; every other row NaN and
the columns before the window freed, so a row read outside the contract would show), the indexer's
picks into topk_indices, and the op must give the stock output. (Every sample of the case database
against the loop oracle, the error inputs, opcheck and compile per sample are in tests/test_cases.py.)
"""
import dataclasses
import importlib
from typing import Optional

import pytest
import torch
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM, DynamicCache
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as stock

from mla_ops import backends, settings
from mla_ops.ops import shared_kv_attention
from mla_ops.testing import suites
from mla_ops.testing.cases import Sample
from mla_ops.testing.oracles import shared_kv_attention_oracle

# the op's module (the package attribute of that name is the public wrapper)
OP_MODULE = importlib.import_module("mla_ops.ops.shared_kv_attention")
WINDOW = 8
RATIOS = {"sliding_attention": None, "compressed_sparse_attention": 4, "heavily_compressed_attention": 8}
INDEX_TOPK = 4
BLOCK_SIZE, ENTRY_BLOCK_SIZE = 3, 2
TOKENS = 40  # > W: windows slide; 10 CSA entries (> INDEX_TOPK), 5 HCA entries
CHUNKINGS = {"one-shot": [40], "chunked-and-decode": [17, 1, 11, 1, 1, 9]}
# Both sides compute in fp32 and differ only in the order of their fp32 sums (stock: matmul over a
# materialised [H, S, L] with finfo.min / -inf masks, then a softmax over L + 1 columns; the op: its
# own rows per query token, P @ rows unrounded). Outputs are O(1) sums of up to 20 rows of mixed sign:
# measured at most 1.4e-6 apart (12 fp32 ulps of 1.0); 4e-6 leaves room for another kernel's order.
FP32_TOLERANCE = dict(rtol=4e-6, atol=4e-6)


@pytest.fixture(params=["reference", "cpu_native"])
def backend(request):
    """Each CPU kernel of the op: the reference kernel and, where the extension is built, the native one."""
    name = request.param
    chosen = backends.BACKENDS[name]
    if "shared_kv_attention" not in chosen.kernels or chosen.unavailable_reason():
        pytest.skip(f"{name} does not serve mla.shared_kv_attention here: "
                    f"{chosen.unavailable_reason() or 'no kernel'}")
    with settings.use_backend(name):
        yield name


@pytest.fixture(scope="module")
def model():
    config = DeepseekV4Config(
        vocab_size=128, hidden_size=64, num_hidden_layers=3, layer_types=list(RATIOS),
        mlp_layer_types=["hash_moe", "moe", "moe"], num_attention_heads=4, num_key_value_heads=1, head_dim=32,
        partial_rotary_factor=0.25, q_lora_rank=32, o_groups=2, o_lora_rank=16, index_n_heads=8, index_head_dim=16,
        index_topk=INDEX_TOPK, sliding_window=WINDOW,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, hc_mult=4,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 256,
                         "beta_fast": 32, "beta_slow": 1},
    )
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(config).eval()
    with torch.no_grad():  # the stock init leaves sinks and position biases 0 and norm weights 1
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "position_bias")) or "norm.weight" in name:
                p.normal_()
    return model


@dataclasses.dataclass
class StockCall:
    """One request's share of one stock attention call: positions seq_len - S .. seq_len - 1."""

    layer_type: str
    seq_len: int
    query: torch.Tensor  # [S, H, D]
    window: torch.Tensor  # [Lw, D]: the window rows of positions seq_len - Lw .. seq_len - 1
    entries: torch.Tensor  # [T, D]: the compressed entries 0 .. T - 1 (T = seq_len // m)
    picks: Optional[torch.Tensor]  # [S, k] the CSA indexer's picks, -1 = none
    sinks: torch.Tensor  # [H]
    output: torch.Tensor  # [S, H, D]: eager_attention_forward's


def _stock_calls(model, ids: torch.Tensor, chunks: list[int], monkeypatch) -> list[list[StockCall]]:
    """Run the stock model over `ids` [B, N] in `chunks` with a DynamicCache; per chunk and layer the
    recorded attention calls, one StockCall per request."""
    recorded, picks = [], []
    original = stock.eager_attention_forward

    def recording(module_, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        output, weights = original(module_, query, key, value, attention_mask, scaling, dropout, **kwargs)
        recorded.append((module_, query, key, output))
        return output, weights

    monkeypatch.setattr(stock, "eager_attention_forward", recording)
    csa = next(layer.self_attn for layer in model.model.layers
               if layer.self_attn.layer_type == "compressed_sparse_attention")
    hook = csa.compressor.indexer.register_forward_hook(lambda mod, args, out: picks.append(out))
    cache = DynamicCache(config=model.config)
    calls, done = [], 0
    try:
        with torch.no_grad():
            for size in chunks:
                recorded.clear()
                model(ids[:, done:done + size], cache=cache, use_cache=True)
                done += size
                per_layer = []
                for attention, query, key, output in recorded:
                    ratio = RATIOS[attention.layer_type]
                    entries = 0 if ratio is None else done // ratio
                    per_layer.append([StockCall(attention.layer_type, done, query[b].transpose(0, 1),
                                                key[b, 0, :key.shape[2] - entries], key[b, 0, key.shape[2] - entries:],
                                                picks[-1][b] if ratio == 4 else None, attention.sinks.detach().clone(),
                                                output[b]) for b in range(ids.shape[0])])
                calls.append(per_layer)
    finally:
        hook.remove()
    return calls


def _paged(calls: list[StockCall], generator: torch.Generator, *, sinks=True):
    """The op's arguments for `calls` (one layer type) as the B requests of one call: shuffled blocks,
    every row the stock call did not hand over NaN, the columns wholly before a request's window -1."""
    layer_type = calls[0].layer_type
    ratio = RATIOS[layer_type]
    dim = calls[0].query.shape[-1]
    tables, entry_tables, lens, starts = [], [], [], [0]
    columns = max(-(-c.seq_len // BLOCK_SIZE) for c in calls)
    num_blocks = columns * len(calls) + 2
    order = torch.randperm(num_blocks, generator=generator)
    kv_cache = torch.full((num_blocks, BLOCK_SIZE, 1, dim), float("nan"))
    entry_columns = max([-(-(c.seq_len // ratio) // ENTRY_BLOCK_SIZE) for c in calls] + [1]) if ratio else 1
    entry_blocks = entry_columns * len(calls) + 1
    entry_order = torch.randperm(entry_blocks, generator=generator)
    entry_cache = torch.full((entry_blocks, ENTRY_BLOCK_SIZE, 1, dim), float("nan"))
    for b, c in enumerate(calls):
        row = torch.full((columns,), -1, dtype=torch.int32)
        first = c.seq_len - c.window.shape[0]
        for j in range(first // BLOCK_SIZE, -(-c.seq_len // BLOCK_SIZE)):
            row[j] = order[b * columns + j]
        for i, position in enumerate(range(first, c.seq_len)):
            kv_cache[row[position // BLOCK_SIZE], position % BLOCK_SIZE, 0] = c.window[i]
        tables.append(row)
        entry_row = entry_order[b * entry_columns:(b + 1) * entry_columns].to(torch.int32)
        for w in range(c.entries.shape[0]):
            entry_cache[entry_row[w // ENTRY_BLOCK_SIZE], w % ENTRY_BLOCK_SIZE, 0] = c.entries[w]
        entry_tables.append(entry_row)
        lens.append(c.seq_len)
        starts.append(starts[-1] + c.query.shape[0])
    q = torch.cat([c.query for c in calls])
    args = [q, kv_cache, torch.stack(tables), torch.tensor(lens, dtype=torch.int32),
            torch.tensor(starts, dtype=torch.int32), calls[0].sinks if sinks else None, dim ** -0.5, WINDOW]
    if ratio is not None:
        picks = None
        if calls[0].picks is not None:  # stock's k is min(index_topk, entries so far): padded with -1
            picks = torch.cat([torch.nn.functional.pad(c.picks, (0, INDEX_TOPK - c.picks.shape[1]), value=-1)
                               for c in calls])
        args += [entry_cache, torch.stack(entry_tables), ratio, picks]
    return Sample(layer_type, tuple(args))


def _no_sinks(model):
    """The stock model with every sink at -inf: exp(-inf) adds nothing to the denominator, i.e. no sink."""
    saved = {name: p.detach().clone() for name, p in model.named_parameters() if name.endswith("sinks")}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in saved:
                p.fill_(float("-inf"))
    return saved


@pytest.mark.parametrize("sinks", [True, False], ids=["sinks", "no-sinks"])
@pytest.mark.parametrize("chunking", list(CHUNKINGS))
def test_every_layer_type_matches_the_stock_eager_attention(model, chunking, sinks, backend, monkeypatch):
    """Sliding-window, CSA and HCA layers, two requests per call, every chunk of a prefill (one shot, or
    chunked down to decode steps): the op on the recorded q, rows, entries and picks gives what the
    stock eager_attention_forward gave. Without sinks the stock side runs with sinks = -inf."""
    saved = None if sinks else _no_sinks(model)
    try:
        ids = torch.randint(2, 128, (2, TOKENS), generator=torch.Generator().manual_seed(1))
        calls = _stock_calls(model, ids, CHUNKINGS[chunking], monkeypatch)
    finally:
        if saved:
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if name in saved:
                        p.copy_(saved[name])
    generator = torch.Generator().manual_seed(2)
    checked = set()
    for chunk in calls:
        for per_request in chunk:
            sample = _paged(per_request, generator, sinks=sinks)
            got = shared_kv_attention(*sample.args)
            torch.testing.assert_close(got, torch.cat([c.output for c in per_request]), **FP32_TOLERANCE)
            checked.add(sample.name)
    assert checked == set(RATIOS)


def test_a_mixed_batch_matches_the_stock_calls_of_its_requests(model, backend, monkeypatch):
    """One call serving a decode step, a whole prefill and a chunk continuing a prefill of three
    different sequences (each recorded from its own stock run) gives each request its stock output."""
    ids = torch.randint(2, 128, (1, TOKENS), generator=torch.Generator().manual_seed(3))
    chunked = _stock_calls(model, ids, CHUNKINGS["chunked-and-decode"], monkeypatch)
    one_shot = _stock_calls(model, torch.flip(ids, (1,)), [TOKENS], monkeypatch)
    generator = torch.Generator().manual_seed(4)
    for layer in range(len(RATIOS)):
        requests = [chunked[3][layer][0], one_shot[0][layer][0], chunked[2][layer][0]]  # decode, prefill, chunk
        sample = _paged(requests, generator)
        torch.testing.assert_close(shared_kv_attention(*sample.args),
                                   torch.cat([c.output for c in requests]), **FP32_TOLERANCE)


def _one_request(seq_len: int, *, ratio=4, topk=None, seed=0):
    """Random pools for one request of seq_len tokens, and `args(first, last)`: the op's arguments for
    the query positions first .. last - 1 with seq_len = last. CSA picks are one fixed list per
    position, the same for every chunking."""
    g = torch.Generator().manual_seed(seed)
    heads, dim = 4, 32
    num_blocks = -(-seq_len // BLOCK_SIZE)
    entry_blocks = -(-(seq_len // ratio) // ENTRY_BLOCK_SIZE) or 1
    q_all = torch.randn(seq_len, heads, dim, generator=g)
    kv_cache = torch.randn(num_blocks, BLOCK_SIZE, 1, dim, generator=g)
    entry_cache = torch.randn(entry_blocks, ENTRY_BLOCK_SIZE, 1, dim, generator=g)
    sinks = torch.randn(heads, generator=g)
    picks = None
    if topk is not None:
        picks = torch.full((seq_len, topk), -1, dtype=torch.int64)
        for p in range(seq_len):
            seen = torch.randperm((p + 1) // ratio, generator=g)[:topk]
            picks[p, :seen.shape[0]] = seen
    tables = torch.randperm(num_blocks, generator=g).to(torch.int32)[None]
    entry_tables = torch.randperm(entry_blocks, generator=g).to(torch.int32)[None]

    def args(first: int, last: int) -> tuple:
        return (q_all[first:last], kv_cache, tables, torch.tensor([last]), torch.tensor([0, last - first]), sinks,
                dim ** -0.5, WINDOW, entry_cache, entry_tables, ratio, None if picks is None else picks[first:last])
    return args


@pytest.mark.parametrize("topk", [None, 3], ids=["all-visible-entries", "listed-entries"])
def test_chunked_prefill_and_decode_equal_one_shot_prefill(topk, backend):
    """A prompt served in chunks (q_b < seq_len) and decode steps gives, token for token, what one
    prefill over the whole prompt gives: a token's answer depends on its position only."""
    args = _one_request(45, topk=topk)
    whole = shared_kv_attention(*args(0, 45))
    pieces, done = [], 0
    for size in [17, 1, 11, 1, 1, 14]:
        pieces.append(shared_kv_attention(*args(done, done + size)))
        done += size
    torch.testing.assert_close(torch.cat(pieces), whole, rtol=0, atol=0)


def test_query_tokens_in_chunks_give_the_same_answer(monkeypatch):
    """The reference processes query tokens in chunks (a long prefill never holds [T, H, context] at
    once): chunks of 1 to 3 tokens give what one chunk of all 45 gives, bit for bit."""
    args = _one_request(45, topk=3)(0, 45)
    whole = OP_MODULE.shared_kv_attention_reference(*args)
    monkeypatch.setattr(OP_MODULE, "_CHUNK_ELEMENTS", 2000)
    chunked = OP_MODULE.shared_kv_attention_reference(*args)
    assert torch.equal(chunked, whole)
    torch.testing.assert_close(chunked, shared_kv_attention_oracle(*args)[0].float(), **FP32_TOLERANCE)


def test_wider_tables_give_the_same_answer(model, backend, monkeypatch):
    """Block tables wider than the requests need (a serving engine sizes them for the longest request
    it may hold; -1 in the spare columns) change nothing: only the blocks of the window and of the
    entries attended are used."""
    ids = torch.randint(2, 128, (2, TOKENS), generator=torch.Generator().manual_seed(5))
    calls = _stock_calls(model, ids, [23, 1, 16], monkeypatch)
    generator = torch.Generator().manual_seed(6)
    for chunk in calls:
        for per_request in chunk:
            sample = _paged(per_request, generator)
            args = list(sample.args)
            args[2] = torch.nn.functional.pad(args[2], (0, 5), value=-1)
            if len(args) > 8:
                args[9] = torch.nn.functional.pad(args[9], (0, 7), value=-1)
            torch.testing.assert_close(shared_kv_attention(*args), shared_kv_attention(*sample.args),
                                       **FP32_TOLERANCE)


def test_opcheck_and_one_compiled_node_on_stock_inputs(model, monkeypatch):
    """torch.library.opcheck (schema, fake, autograd registration, AOT dispatch) and
    torch.compile(fullgraph=True) as one node, on the recorded calls of every layer type."""
    ids = torch.randint(2, 128, (1, 20), generator=torch.Generator().manual_seed(7))
    calls = _stock_calls(model, ids, [19, 1], monkeypatch)
    generator = torch.Generator().manual_seed(8)
    for chunk in calls:
        for per_request in chunk:
            sample = _paged(per_request, generator)
            suites.run_opcheck("shared_kv_attention", sample)
            suites.compiles_to_one_node("shared_kv_attention", sample)


def test_a_compiled_v4_attention_step_is_one_graph():
    """The op between the torch ops of a V4 attention step (the query scaled in, the inverse rotation of
    the trailing rope dims out) compiles with fullgraph=True to one graph holding the op once, and
    computes what eager does."""
    g = torch.Generator().manual_seed(9)
    # 5 query tokens at positions 25..29: their windows span positions 18..29; 7 CSA entries
    picks = torch.tensor([[0, 3, -1, -1], [5, 4, 1, -1], [2, -1, -1, -1], [-1] * 4, [4] * 4])
    sample = _paged([StockCall("compressed_sparse_attention", 30, torch.randn(5, 4, 32, generator=g),
                               torch.randn(WINDOW - 1 + 5, 32, generator=g), torch.randn(7, 32, generator=g), picks,
                               torch.randn(4, generator=g), torch.empty(0))], g)
    q, *rest = sample.args
    cos, sin = torch.randn(5, 4, generator=g), torch.randn(5, 4, generator=g)

    def step(q, cos, sin):
        out = torch.ops.mla.shared_kv_attention(q * 1.0, *rest)
        return torch.ops.mla.rope(out[..., -8:].transpose(0, 1), cos, -sin, layout="interleaved")

    capture = suites.GraphCapture()
    torch._dynamo.reset()
    compiled = torch.compile(step, backend=capture, fullgraph=True)
    got = compiled(q, cos, sin)
    assert len(capture.graphs) == 1
    assert capture.op_nodes("shared_kv_attention") == 1
    assert torch.equal(got, step(q, cos, sin))


def test_gradients_are_refused_with_the_fix():
    """Inference-only: a query that requires grad gets the refusal naming torch.no_grad."""
    # 2 query tokens at positions 10, 11: window rows 3..11; one HCA entry (12 // 8)
    sample = _paged([StockCall("heavily_compressed_attention", 12, torch.randn(2, 4, 32),
                               torch.randn(WINDOW - 1 + 2, 32), torch.randn(1, 32), None, torch.randn(4),
                               torch.empty(0))], torch.Generator().manual_seed(10))
    q = sample.args[0].requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"mla\.shared_kv_attention is inference-only.*torch\.no_grad"):
        shared_kv_attention(q, *sample.args[1:])
    with torch.no_grad():
        assert torch.isfinite(shared_kv_attention(*sample.args)).all()
