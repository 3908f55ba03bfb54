"""torch.compile(fullgraph=True) and torch.export: every op traces as one graph node, with no
graph break, and compiled outputs equal eager outputs."""
import expecttest
import pytest
import torch

import mla_ops  # noqa: F401

from utils import SMALL, paged_case, prolog_inputs, prolog_kwargs, rope_tables


class GraphCapture:
    """A torch.compile backend that records the FX graphs Dynamo hands over, then runs them."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def targets(self):
        return [node.target for gm in self.graphs for node in gm.graph.nodes if node.op == "call_function"]


def _cases():
    d = SMALL
    hidden, kv_a, kv_a_b, norm_w, kv_b, cos, sin = prolog_inputs(d, torch.float32, bias=True)
    kc, vc, tables, cumsum, offsets = paged_case(10, 4, [5, 3], key_shape=(1, d.L), value_shape=(1, d.R),
                                                 dtype=torch.float32, offsets=[4, 0], columns=4)
    key, value = torch.zeros(8, 1, d.L), torch.zeros(8, 1, d.R)
    q_latent, q_pe = torch.randn(2, d.N, d.L), torch.randn(2, d.N, d.R)
    x = torch.randn(d.B, d.N, d.S, d.R)

    def gather(kc, vc, tables, cumsum, offsets, key, value):
        key, value = key.clone(), value.clone()
        torch.ops.mla.gather_pa_kv_cache(kc, vc, tables, cumsum, key, value, seq_offset=offsets,
                                         is_seq_lens_cumsum=True)
        return key * 2, value

    def scatter(key, value, kc, vc, slots):
        kc, vc = kc.clone(), vc.clone()
        torch.ops.mla.scatter_pa_kv_cache(key, value, kc, vc, slots)
        return kc, vc + 1

    return {
        "rms_norm": (lambda x, w: torch.ops.mla.rms_norm(x, w, 1e-6) * 2, (hidden, torch.rand(d.H))),
        "rope": (lambda x, c, s: torch.ops.mla.rope(x, c, s, layout="half") + 1, (x, cos, sin)),
        "kv_prolog": (lambda *a: torch.ops.mla.kv_prolog(*a, **prolog_kwargs(d)),
                      (hidden, kv_a, kv_a_b, norm_w, kv_b, cos, sin)),
        "latent_kv_prolog": (lambda *a: torch.ops.mla.latent_kv_prolog(*a, eps=1e-5),
                             (hidden, kv_a, None, norm_w, cos, sin)),
        "gather_pa_kv_cache": (gather, (kc, vc, tables, cumsum, offsets, key, value)),
        "gather_pa_kv_cache_functional": (
            lambda *a: torch.ops.mla.gather_pa_kv_cache_functional(*a, is_seq_lens_cumsum=True),
            (kc, vc, tables, cumsum, key, value)),
        "scatter_pa_kv_cache": (scatter, (torch.randn(3, 1, d.L), torch.randn(3, 1, d.R), kc, vc,
                                          torch.tensor([2, -1, 17]))),
        "mla_decode_attention": (lambda *a: torch.ops.mla.mla_decode_attention(*a, 0.25),
                                 (q_latent, q_pe, kc, vc, tables, torch.tensor([5, 3]))),
    }


CASES = _cases()


@pytest.mark.parametrize("op", list(CASES))
def test_fullgraph_compile_single_node_no_graph_break(op):
    fn, args = CASES[op]
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(fn)(*args)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    capture = GraphCapture()
    compiled = torch.compile(fn, backend=capture, fullgraph=True)
    out = compiled(*args)
    targets = capture.targets()
    overload_packet = getattr(torch.ops.mla, op)
    assert sum(t in (overload_packet, overload_packet.default) for t in targets) == 1, targets
    torch.testing.assert_close(out, fn(*args), rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("op", ["kv_prolog", "gather_pa_kv_cache", "mla_decode_attention"])
def test_inductor_compile_matches_eager(op):
    fn, args = CASES[op]
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, dynamic=False)
    torch.testing.assert_close(compiled(*args), fn(*args), rtol=0, atol=0)


class KVProlog(torch.nn.Module):
    """The MLA KV prolog of one attention layer, as a module holding nn.Linear-layout weights."""

    def __init__(self, hidden=32, lora=16, rope=8, heads=2, nope=8, v=8):
        super().__init__()
        self.kv_a = torch.nn.Linear(hidden, lora + rope, bias=False)
        self.norm = torch.nn.Parameter(torch.ones(lora))
        self.kv_b = torch.nn.Linear(lora, heads * (nope + v), bias=False)
        self.heads, self.nope, self.v = heads, nope, v

    def forward(self, hidden, cos, sin):
        k_nope, value, k_pe = torch.ops.mla.kv_prolog(
            hidden, self.kv_a.weight, None, self.norm, self.kv_b.weight, cos, sin, num_heads=self.heads,
            qk_nope_head_dim=self.nope, v_head_dim=self.v)
        return torch.cat((k_nope, k_pe.expand(-1, self.heads, -1, -1)), dim=-1), value


class TestExport(expecttest.TestCase):
    def test_export_holds_kv_prolog_as_one_node(self):
        module = KVProlog()
        cos, sin = rope_tables(2, 5, 8)
        args = (torch.randn(2, 5, 32), cos, sin)
        exported = torch.export.export(module, args)
        ops = [str(n.target) for n in exported.graph.nodes if isinstance(n.target, torch._ops.OpOverload)]
        self.assertExpectedInline("\n".join(ops), """\
mla.kv_prolog.default
aten.expand.default
aten.cat.default""")
        torch.testing.assert_close(exported.module()(*args), module(*args), rtol=0, atol=0)

    def test_export_with_dynamic_sequence_length(self):
        module = KVProlog()
        seq = torch.export.Dim("seq", min=2, max=512)
        cos, sin = rope_tables(1, 6, 8)
        exported = torch.export.export(module, (torch.randn(1, 6, 32), cos, sin),
                                       dynamic_shapes=({1: seq}, {1: seq}, {1: seq}))
        cos, sin = rope_tables(1, 17, 8)
        args = (torch.randn(1, 17, 32), cos, sin)
        torch.testing.assert_close(exported.module()(*args), module(*args), rtol=0, atol=0)
