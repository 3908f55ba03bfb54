"""Compilation beyond the per-sample suites of tests/test_cases.py: inductor-compiled graphs equal
eager, and a module holding kv_prolog exports (static and dynamic sequence length) with the op as one node."""
import expecttest
import pytest
import torch

import mla_ops  # noqa: F401

from utils import rope_tables


@pytest.mark.slow
@pytest.mark.parametrize("op,name", [("kv_prolog", "small-bias-half"), ("gather_pa_kv_cache",
                                                                        "cumsum-offset-uncovered-rows"),
                                     ("mla_decode_attention", "ragged"),
                                     ("mla_prefill_attention", "prefill-decode-chunk"),
                                     ("mha_prefill_attention", "context-and-new")])
def test_inductor_compile_matches_eager(op, name):
    """Inductor (not only Dynamo's graph capture, which tests/test_cases.py checks for every sample)
    runs the op inside a compiled graph with eager's results."""
    from mla_ops.testing import suites
    from mla_ops.testing.cases import CASES

    fn, tensors = suites.tensor_function(op, CASES[op].sample(torch.float32, name))
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, dynamic=False)
    for got, want in zip(compiled(*tensors), fn(*tensors)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


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
