"""A tour of every torch.ops.mla op on DeepSeek-V2-Lite's dimensions, then the torch.compile graph.

Run: .venv/bin/python examples/ops_tour.py
Shapes: hidden 2048, 16 heads, kv_lora_rank L=512, rope R=64, nope P=128, v V=128, bf16.
"""
import math

import torch

import mla_ops

torch.manual_seed(0)
B, S, H, N, L, R, P, V = 1, 8, 2048, 16, 512, 64, 128, 128
dt = torch.bfloat16


def show(name, *tensors):
    print(f"  {name:<40}" + "  ".join(f"{tuple(t.shape)}" for t in tensors))


hidden = torch.randn(B, S, H, dtype=dt)
kv_a = (torch.randn(L + R, H) * H ** -0.5).to(dt)
norm_w = torch.ones(L, dtype=dt)
kv_b = (torch.randn(N * (P + V), L) * L ** -0.5).to(dt)
positions = torch.arange(S, dtype=torch.float32)
inv_freq = 1.0 / (10000 ** (torch.arange(0, R, 2, dtype=torch.float32) / R))
cos = torch.cos(positions[:, None] * inv_freq)[None]  # [1, S, R/2]
sin = torch.sin(positions[:, None] * inv_freq)[None]

print("eager calls (output shapes):")
show("mla.rms_norm", mla_ops.rms_norm(hidden, torch.ones(H, dtype=dt)))
show("mla.rope (q_pe)", mla_ops.rope(torch.randn(B, N, S, R, dtype=dt), cos, sin))
k_nope, value, k_pe = mla_ops.kv_prolog(hidden, kv_a, None, norm_w, kv_b, cos, sin,
                                        num_heads=N, qk_nope_head_dim=P, v_head_dim=V)
show("mla.kv_prolog -> k_nope, value, k_pe", k_nope, value, k_pe)
latent, k_pe_latent = mla_ops.latent_kv_prolog(hidden, kv_a, None, norm_w, cos, sin)
show("mla.latent_kv_prolog -> latent, k_pe", latent, k_pe_latent)

# A paged latent cache: 8 blocks of 4 tokens; the sequence's 8 tokens live in blocks 5 and 2.
block_size, num_blocks = 4, 8
key_cache = torch.zeros(num_blocks, block_size, 1, L, dtype=dt)
value_cache = torch.zeros(num_blocks, block_size, 1, R, dtype=dt)
block_tables = torch.tensor([[5, 2]], dtype=torch.int32)
slots = torch.tensor([5 * block_size + t for t in range(4)] + [2 * block_size + t for t in range(4)])
mla_ops.scatter_pa_kv_cache(latent.view(S, 1, L), k_pe_latent.view(S, 1, R), key_cache, value_cache, slots)
show("mla.scatter_pa_kv_cache -> caches", key_cache, value_cache)
key, val = mla_ops.gather_pa_kv_cache(key_cache, value_cache, block_tables, torch.tensor([S], dtype=torch.int32))
assert torch.equal(key.view(B, S, L), latent) and torch.equal(val.view(B, S, R), k_pe_latent)
show("mla.gather_pa_kv_cache -> key, value", key, val)
q_latent = torch.randn(B, N, L, dtype=dt)
o_latent = mla_ops.mla_decode_attention(q_latent, torch.randn(B, N, R, dtype=dt), key_cache, value_cache,
                                        block_tables, torch.tensor([S]), 1 / math.sqrt(P + R))
show("mla.mla_decode_attention -> o_latent", o_latent)


def mla_kv_step(hidden, cos, sin):
    k_nope, value, k_pe = torch.ops.mla.kv_prolog(hidden, kv_a, None, norm_w, kv_b, cos, sin,
                                                  num_heads=N, qk_nope_head_dim=P, v_head_dim=V)
    key = torch.cat((k_nope, k_pe.expand(-1, N, -1, -1)), dim=-1)
    return key, value


graphs = []


def capture(gm, example_inputs):
    graphs.append(gm)
    return gm.forward


compiled = torch.compile(mla_kv_step, backend=capture, fullgraph=True)
key_c, value_c = compiled(hidden, cos, sin)
assert torch.equal(key_c, mla_kv_step(hidden, cos, sin)[0])
print("\ntorch.compile(fullgraph=True) graph of a KV step (the mla op is one node):")
print(graphs[0].code.strip())
explanation = torch._dynamo.explain(mla_kv_step)(hidden, cos, sin)
print(f"graphs: {explanation.graph_count}, graph breaks: {explanation.graph_break_count}")
