"""Every `mla::` operator schema, written once (ARCHITECTURE §3).

Kernels and fake kernels only attach to these names; nothing else in the project may define an
`mla::` schema. Shapes below: B batch, S tokens, H hidden, N heads, L kv_lora_rank, R rope dim,
P qk_nope_head_dim, V v_head_dim.

Mutation annotations: `Tensor(a!)` marks an argument the op writes in place. Mutating ops return
`()` (never the mutated input), which is what torch.compile's auto-functionalization and
torch_npu's own `npu_gather_pa_kv_cache` expect. `gather_pa_kv_cache`'s argument names, order and
defaults equal `torch_npu.npu_gather_pa_kv_cache` so code moves between the namespaces unchanged.
"""

# §3.1  x [..., H] -> [..., H]
RMS_NORM = "rms_norm(Tensor x, Tensor weight, float eps=1e-06) -> Tensor"

# §3.2  x [..., S, D], cos/sin [B, S, D/2] or [S, D/2] -> [..., S, D]
ROPE = 'rope(Tensor x, Tensor cos, Tensor sin, *, str layout="interleaved") -> Tensor'

# §3.3  hidden_states [B, S, H] -> k_nope [B, N, S, P], value [B, N, S, V], k_pe [B, 1, S, R]
KV_PROLOG = (
    "kv_prolog(Tensor hidden_states, Tensor kv_a_weight, Tensor? kv_a_bias, Tensor kv_norm_weight, "
    "Tensor kv_b_weight, Tensor cos, Tensor sin, *, int num_heads, int qk_nope_head_dim, "
    'int v_head_dim, float eps=1e-06, str rope_layout="interleaved") '
    "-> (Tensor k_nope, Tensor value, Tensor k_pe)"
)

# §3.4  hidden_states [B, S, H] -> latent [B, S, L], k_pe [B, S, R]
LATENT_KV_PROLOG = (
    "latent_kv_prolog(Tensor hidden_states, Tensor kv_a_weight, Tensor? kv_a_bias, "
    'Tensor kv_norm_weight, Tensor cos, Tensor sin, *, float eps=1e-06, str rope_layout="interleaved") '
    "-> (Tensor latent, Tensor k_pe)"
)

# §3.5  key [T, Hk, Dk], value [T, Hv, Dv] written into [num_blocks, block_size, heads, dim] caches
SCATTER_PA_KV_CACHE = (
    "scatter_pa_kv_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
    "Tensor slot_mapping) -> ()"
)

GATHER_PA_KV_CACHE = (
    "gather_pa_kv_cache(Tensor key_cache, Tensor value_cache, Tensor block_tables, Tensor seq_lens, "
    "Tensor(a!) key, Tensor(b!) value, *, Tensor? seq_offset=None, bool is_seq_lens_cumsum=False) -> ()"
)

# The functional twin (torch_npu's `_functional`): returns updated copies of key/value instead of
# writing them; what a graph compiler maps back onto the in-place op.
GATHER_PA_KV_CACHE_FUNCTIONAL = (
    "gather_pa_kv_cache_functional(Tensor key_cache, Tensor value_cache, Tensor block_tables, "
    "Tensor seq_lens, Tensor key, Tensor value, *, Tensor? seq_offset=None, "
    "bool is_seq_lens_cumsum=False) -> (Tensor, Tensor)"
)

# §3.6  q_latent [B, N, L], q_pe [B, N, R] over the paged latent cache -> o_latent [B, N, L]
MLA_DECODE_ATTENTION = (
    "mla_decode_attention(Tensor q_latent, Tensor q_pe, Tensor key_cache, Tensor value_cache, "
    "Tensor block_tables, Tensor seq_lens, float softmax_scale) -> Tensor"
)

ALL_SCHEMAS: dict[str, str] = {
    "rms_norm": RMS_NORM,
    "rope": ROPE,
    "kv_prolog": KV_PROLOG,
    "latent_kv_prolog": LATENT_KV_PROLOG,
    "scatter_pa_kv_cache": SCATTER_PA_KV_CACHE,
    "gather_pa_kv_cache": GATHER_PA_KV_CACHE,
    "gather_pa_kv_cache_functional": GATHER_PA_KV_CACHE_FUNCTIONAL,
    "mla_decode_attention": MLA_DECODE_ATTENTION,
}
