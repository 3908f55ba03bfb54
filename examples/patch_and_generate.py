"""Patch a transformers DeepSeek-V2 model onto torch.ops.mla and generate: stock, cache="dense" and
cache="paged" side by side (same tokens, different cache memory), then torch.export one KV prolog.

Run: .venv/bin/python examples/patch_and_generate.py
Uses the built-in timing model (V2-Lite attention dims, random weights), fp32 so greedy tokens are exact.
"""
import torch

import mla_ops
from mla_ops.cli.loading import lite_dims_model
from mla_ops.integrations.transformers import cache_bytes_per_token_per_layer

model, tokenizer = lite_dims_model(torch.float32, torch.device("cpu"))
prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is multi-head latent attention?"}],
                                       add_generation_prompt=True, tokenize=False)
ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
settings = dict(max_new_tokens=24, min_new_tokens=24, do_sample=False, return_dict_in_generate=True)


with torch.no_grad():
    stock = model.generate(ids, **settings)
    results = {"stock": stock}
    for mode in ("dense", "paged"):
        with mla_ops.patch(model, cache=mode):
            results[mode] = model.generate(ids, **settings)

tokens = ids.shape[1] + 23  # the last generated token is not cached yet
for name, out in results.items():
    same = torch.equal(out.sequences, stock.sequences)
    print(f"{name:<6} tokens identical to stock: {same}; cache {type(out.cache).__name__}, "
          f"{cache_bytes_per_token_per_layer(out.cache, tokens):.0f} B per token and layer (fp32)")

# torch.export of the first layer's KV prolog: one mla.kv_prolog node in the graph.
attn = model.model.layers[0].self_attn


class KVProlog(torch.nn.Module):
    def forward(self, hidden, cos, sin):
        return torch.ops.mla.kv_prolog(hidden, attn.kv_a_proj_with_mqa.weight, None, attn.kv_a_layernorm.weight,
                                       attn.kv_b_proj.weight, cos, sin, num_heads=attn.num_heads,
                                       qk_nope_head_dim=attn.qk_nope_head_dim, v_head_dim=attn.v_head_dim)


freqs = model.model.rotary_emb(torch.empty(0), torch.arange(5)[None])
exported = torch.export.export(KVProlog(), (torch.randn(1, 5, model.config.hidden_size), freqs.real, freqs.imag))
print("exported graph:", [str(n.target) for n in exported.graph.nodes if n.op == "call_function"])
