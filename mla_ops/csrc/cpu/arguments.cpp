// The metadata checks of the ops the native kernels serve: each function is the C++ twin of the
// Python check named in its comment (same conditions, same order, same messages; see checks.h).
// They look at ranks, sizes, dtypes and devices only; index values are the kernels' own checks.
#include "arguments.h"

#include "checks.h"

namespace mla_native {
namespace {

constexpr const char* kCacheLayout = "[num_blocks, block_size, heads, dim]";

// mla_ops/ops/_paged.py: check_cache_pair
void check_cache_pair(std::string_view op, const at::Tensor& key_cache, const at::Tensor& value_cache) {
  check_rank(op, "key_cache", key_cache, 4, kCacheLayout);
  check_rank(op, "value_cache", value_cache, 4, kCacheLayout);
  check_size(op, "value_cache", value_cache.size(0), key_cache.size(0), "num_blocks (dim 0) must equal key_cache's");
  check_size(op, "value_cache", value_cache.size(1), key_cache.size(1), "block_size (dim 1) must equal key_cache's");
  TORCH_CHECK(key_cache.size(0) >= 1, prefix(op), "key_cache needs at least one block (dim 0), got 0");
  TORCH_CHECK(key_cache.size(1) >= 1, prefix(op), "block_size (key_cache dim 1) must be >= 1, got 0");
}

// mla_ops/ops/_paged.py: check_token_tensor
void check_token_tensor(std::string_view op, std::string_view name, const at::Tensor& t, std::string_view cache_name,
                        const at::Tensor& cache) {
  check_rank(op, name, t, 3, "[tokens, heads, dim]");
  check_size(op, name, t.size(1), cache.size(2), "heads (dim 1) must equal " + std::string(cache_name) + ".shape[2]");
  check_size(op, name, t.size(2), cache.size(3),
             "head dim (dim 2) must equal " + std::string(cache_name) + ".shape[3]");
  check_same_dtype(op, name, t, cache_name, cache);
}

// mla_ops/_checks.py: check_rope_tables (batch: the batch size of the rotated tensor)
void check_rope_tables(std::string_view op, std::string_view x_name, const at::Tensor& cos, const at::Tensor& sin,
                       int64_t rope_dim, int64_t seq_len, int64_t batch) {
  for (const auto& [name, t] : {NamedTensor{"cos", &cos}, NamedTensor{"sin", &sin}}) {
    check_float(op, name, *t);
    TORCH_CHECK(t->dim() == 2 || t->dim() == 3, prefix(op), name,
                " must be [B, S, R/2] or [S, R/2] (one value per rotation pair, e.g. freqs_cis.real / .imag), got "
                "shape ",
                py_shape(*t));
  }
  TORCH_CHECK(cos.sizes() == sin.sizes(), prefix(op), "cos and sin must have the same shape, got ", py_shape(cos),
              " and ", py_shape(sin));
  TORCH_CHECK(rope_dim % 2 == 0, prefix(op), "the rotary dim of ", x_name, " must be even (rotation pairs), got ",
              rope_dim);
  check_size(op, "cos", cos.size(-1), rope_dim / 2, "last dim must be half the rotary dim of " + std::string(x_name));
  check_size(op, "cos", cos.size(-2), seq_len,
             "sequence dim must equal the sequence length of " + std::string(x_name));
  if (cos.dim() == 3) {
    TORCH_CHECK(cos.size(0) == batch || cos.size(0) == 1, prefix(op), "cos batch dim must be 1 or ", batch,
                " (the batch of ", x_name, "), got ", cos.size(0));
  }
}

// mla_ops/_checks.py: check_layout / check_rope_compute_dtype
void check_rope_options(std::string_view op, std::string_view rope_layout, std::string_view rope_compute_dtype) {
  TORCH_CHECK(rope_layout == "interleaved" || rope_layout == "half" || rope_layout == "neox", prefix(op),
              "rope_layout must be one of ", py_repr_tuple({"interleaved", "half", "neox"}), ", got ",
              py_repr(rope_layout));
  TORCH_CHECK(rope_compute_dtype == "float32" || rope_compute_dtype == "activation", prefix(op),
              "rope_compute_dtype must be one of ", py_repr_tuple({"float32", "activation"}),
              " (\"float32\": rotate in fp32 and round once; \"activation\": round like x*cos + rotate_half(x)*sin in "
              "x's dtype), got ",
              py_repr(rope_compute_dtype));
}

// mla_ops/ops/kv_prolog.py: _check_stage1_args
void check_stage1_args(std::string_view op, const at::Tensor& hidden, const at::Tensor& kv_a_weight,
                       const std::optional<at::Tensor>& kv_a_bias, const at::Tensor& kv_norm_weight,
                       const at::Tensor& cos, const at::Tensor& sin, double eps, std::string_view rope_layout,
                       std::string_view rope_compute_dtype) {
  check_rope_options(op, rope_layout, rope_compute_dtype);
  check_float(op, "hidden_states", hidden);
  check_rank(op, "hidden_states", hidden, 3, "[batch, seq, hidden]");
  check_rank(op, "kv_a_weight", kv_a_weight, 2, "[kv_lora_rank + rope_dim, hidden] (nn.Linear layout)");
  check_rank(op, "kv_norm_weight", kv_norm_weight, 1, "[kv_lora_rank]");
  check_same_dtype(op, "kv_a_weight", kv_a_weight, "hidden_states", hidden);
  check_same_dtype(op, "kv_norm_weight", kv_norm_weight, "hidden_states", hidden);
  check_size(op, "kv_a_weight", kv_a_weight.size(1), hidden.size(2),
             "in_features (dim 1) must equal the hidden size of hidden_states");
  const int64_t rows = kv_a_weight.size(0), lora_rank = kv_norm_weight.size(0);
  const int64_t rope_dim = rows - lora_rank;  // sizes are < 2**62: no overflow
  TORCH_CHECK(rope_dim > 0, prefix(op), "kv_a_weight has ", rows, " output rows, which must be kv_lora_rank (",
              lora_rank, ", the size of kv_norm_weight) + rope_dim (> 0)");
  const bool tables_ranked = cos.dim() == 2 || cos.dim() == 3;
  TORCH_CHECK(rope_dim % 2 == 0 || !tables_ranked, prefix(op), "kv_norm_weight has ", lora_rank,
              " entries, but kv_a_weight's ", rows, " output rows minus the rotary dim ", 2 * cos.size(-1),
              " (twice the last dim of cos) leave kv_lora_rank = ", rows - 2 * cos.size(-1),
              "; pass kv_a_layernorm.weight of that size");
  if (kv_a_bias.has_value()) {
    check_rank(op, "kv_a_bias", *kv_a_bias, 1, "[kv_lora_rank + rope_dim]");
    check_size(op, "kv_a_bias", kv_a_bias->size(0), rows, "length must equal kv_a_weight's output rows");
    check_same_dtype(op, "kv_a_bias", *kv_a_bias, "hidden_states", hidden);
  }
  check_rope_tables(op, "k_pe", cos, sin, rope_dim, hidden.size(1), hidden.size(0));
  TORCH_CHECK(eps >= 0.0, prefix(op), "eps must be >= 0, got ", py_float(eps));
  check_same_device(op, {{"hidden_states", &hidden},
                         {"kv_a_weight", &kv_a_weight},
                         {"kv_a_bias", kv_a_bias.has_value() ? &*kv_a_bias : nullptr},
                         {"kv_norm_weight", &kv_norm_weight},
                         {"cos", &cos},
                         {"sin", &sin}});
}

// mla_ops/ops/gather_pa_kv_cache.py: _check_gather_args
void check_gather_args(std::string_view op, const at::Tensor& key_cache, const at::Tensor& value_cache,
                       const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& key,
                       const at::Tensor& value, const std::optional<at::Tensor>& seq_offset, bool is_seq_lens_cumsum,
                       bool writes_outputs) {
  check_cache_pair(op, key_cache, value_cache);
  check_token_tensor(op, "key", key, "key_cache", key_cache);
  check_token_tensor(op, "value", value, "value_cache", value_cache);
  check_size(op, "value", value.size(0), key.size(0), "row count (dim 0) must equal key's");
  check_index(op, "block_tables", block_tables);
  check_rank(op, "block_tables", block_tables, 2, "[num_seqs, max_blocks_per_seq]");
  check_index(op, "seq_lens", seq_lens);
  check_rank(op, "seq_lens", seq_lens, 1,
             "[num_seqs + 1] (cumulative, is_seq_lens_cumsum=True) or [num_seqs] (lengths)");
  const int64_t num_seqs = block_tables.size(0);
  if (is_seq_lens_cumsum) {
    check_size(op, "seq_lens", seq_lens.size(0), num_seqs + 1,
               "must have num_seqs + 1 entries (a cumulative sum starting at 0) when is_seq_lens_cumsum=True; pass "
               "per-sequence lengths with is_seq_lens_cumsum=False");
  } else {
    check_size(op, "seq_lens", seq_lens.size(0), num_seqs,
               "must have one length per sequence (block_tables rows) when is_seq_lens_cumsum=False; pass a "
               "cumulative [num_seqs + 1] tensor with is_seq_lens_cumsum=True");
  }
  if (seq_offset.has_value()) {
    check_index(op, "seq_offset", *seq_offset);
    check_rank(op, "seq_offset", *seq_offset, 1, "[num_seqs]");
    check_size(op, "seq_offset", seq_offset->size(0), num_seqs, "needs one offset per sequence");
  }
  check_same_device(op, {{"key_cache", &key_cache},
                         {"value_cache", &value_cache},
                         {"block_tables", &block_tables},
                         {"seq_lens", &seq_lens},
                         {"key", &key},
                         {"value", &value},
                         {"seq_offset", seq_offset.has_value() ? &*seq_offset : nullptr}});
  if (writes_outputs) {
    check_writable_layout(op, "key", key);
    check_writable_layout(op, "value", value);
  }
}

// mla_ops/ops/_paged.py: check_latent_query_and_caches (`rows` names dim 0 of the queries: "tokens", "batch")
void check_latent_query_and_caches(std::string_view op, std::string_view rows, const at::Tensor& q_latent,
                                   const at::Tensor& q_pe, const at::Tensor& key_cache,
                                   const at::Tensor& value_cache) {
  const std::string r(rows);
  check_float(op, "q_latent", q_latent);
  check_rank(op, "q_latent", q_latent, 3, "[" + r + ", heads, kv_lora_rank] (q_nope absorbed with W_UK)");
  check_rank(op, "q_pe", q_pe, 3, "[" + r + ", heads, rope_dim] (rotated)");
  check_same_dtype(op, "q_pe", q_pe, "q_latent", q_latent);
  check_size(op, "q_pe", q_pe.size(0), q_latent.size(0), r + " (dim 0) must equal q_latent's");
  check_size(op, "q_pe", q_pe.size(1), q_latent.size(1), "heads (dim 1) must equal q_latent's");
  check_cache_pair(op, key_cache, value_cache);
  check_size(op, "key_cache", key_cache.size(2), 1, "heads (dim 2) must be 1: MLA caches one shared latent");
  check_size(op, "value_cache", value_cache.size(2), 1, "heads (dim 2) must be 1: MLA caches one shared k_pe");
  check_size(op, "key_cache", key_cache.size(3), q_latent.size(2),
             "dim (dim 3) must equal kv_lora_rank, the last dim of q_latent");
  check_size(op, "value_cache", value_cache.size(3), q_pe.size(2),
             "dim (dim 3) must equal rope_dim, the last dim of q_pe");
  check_same_dtype(op, "key_cache", key_cache, "q_latent", q_latent);
  check_same_dtype(op, "value_cache", value_cache, "q_latent", q_latent);
}

// mla_ops/ops/sparse_attention.py: check_compress_ratio
void check_compress_ratio(std::string_view op, int64_t compress_ratio) {
  TORCH_CHECK(compress_ratio >= 1, prefix(op),
              "compress_ratio must be >= 1 (tokens pooled into one cached entry; 1 when the cache holds one entry per "
              "token), got ",
              compress_ratio);
}

// mla_ops/ops/sparse_attention.py: _check_requests
void check_requests(std::string_view op, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                    const at::Tensor& query_start_loc) {
  check_index(op, "block_tables", block_tables);
  check_rank(op, "block_tables", block_tables, 2, "[batch, max_blocks_per_seq]");
  check_index(op, "seq_lens", seq_lens);
  check_rank(op, "seq_lens", seq_lens, 1, "[batch]");
  check_size(op, "seq_lens", seq_lens.size(0), block_tables.size(0),
             "length must equal the number of block-table rows (one per request)");
  check_index(op, "query_start_loc", query_start_loc);
  check_rank(op, "query_start_loc", query_start_loc, 1, "[batch + 1] (cumulative query tokens per request)");
  check_size(op, "query_start_loc", query_start_loc.size(0), block_tables.size(0) + 1,
             "must have one entry per request plus one (cumulative counts starting at 0)");
}

// mla_ops/ops/shared_kv_attention.py: _check_pool
void check_shared_pool(std::string_view op, std::string_view name, const at::Tensor& pool, const at::Tensor& q,
                       std::string_view rows) {
  check_rank(op, name, pool, 4, "[num_blocks, block_size, 1, head_dim] (" + std::string(rows) + ")");
  check_size(op, name, pool.size(2), 1,
             "heads (dim 2) must be 1: one row per entry, shared by every head as key and value");
  check_size(op, name, pool.size(3), q.size(2), "dim (dim 3) must equal head_dim, q's last dim");
  TORCH_CHECK(pool.size(0) >= 1, prefix(op), name, " needs at least one block (dim 0), got 0");
  TORCH_CHECK(pool.size(1) >= 1, prefix(op), "block_size (", name, " dim 1) must be >= 1, got 0");
  check_same_dtype(op, name, pool, "q", q);
}

// mla_ops/ops/shared_kv_prolog.py: check_norm_weight (a DeepSeek-V4 RMSNorm weight: [size], float32 or the
// activation's dtype)
void check_norm_weight(std::string_view op, std::string_view name, const at::Tensor& weight, int64_t size,
                       std::string_view size_name, const at::Tensor& activation, std::string_view activation_name) {
  check_rank(op, name, weight, 1, "[" + std::string(size_name) + "]");
  check_size(op, name, weight.size(0), size, "length must equal " + std::string(size_name));
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == activation.scalar_type(), prefix(op), name,
              " must be float32 (stock keeps the norm weights in fp32) or ", activation_name, "'s dtype ",
              py_dtype(activation), ", got ", py_dtype(weight));
}

// mla_ops/ops/shared_kv_prolog.py: check_rope_width (R = 2 * cos.shape[-1], at least one pair, at most the head)
void check_rope_width(std::string_view op, std::string_view name, const at::Tensor& cos, int64_t head_dim,
                      std::string_view head_name) {
  TORCH_CHECK(cos.size(-1) >= 1, prefix(op), name,
              " has no rotation pair (last dim 0); pass the rope table, [..., R/2], R >= 2");
  // 128 bits: a last dim near 2**63 must not wrap into a narrow rotation
  const __int128 rope_dim = 2 * static_cast<__int128>(cos.size(-1));
  TORCH_CHECK(rope_dim <= head_dim, prefix(op), "the rotary dim R = ", py_int(rope_dim), " (twice the last dim of ",
              name, ") must not exceed ", head_name, " (", head_dim, "): rope rotates the trailing R channels of each row");
}

// mla_ops/ops/shared_kv_prolog.py: _check_hidden_and_projection
void check_hidden_and_projection(std::string_view op, const at::Tensor& hidden, std::string_view name,
                                 const at::Tensor& weight, std::string_view layout) {
  check_float(op, "hidden_states", hidden);
  check_rank(op, "hidden_states", hidden, 3, "[batch, seq, hidden]");
  check_rank(op, name, weight, 2, layout);
  check_same_dtype(op, name, weight, "hidden_states", hidden);
  check_size(op, name, weight.size(1), hidden.size(2), "in_features (dim 1) must equal the hidden size of hidden_states");
}

// check_size with an expected value computed in 128 bits (a product of sizes), printed as Python prints it
void check_size_wide(std::string_view op, std::string_view name, int64_t actual, __int128 expected,
                     std::string_view what) {
  TORCH_CHECK(actual == expected, prefix(op), name, " ", what, ": expected ", py_int(expected), ", got ", actual);
}

// An optional tensor argument as check_same_device takes it (nullptr: not given).
const at::Tensor* optional(const std::optional<at::Tensor>& t) { return t.has_value() ? &*t : nullptr; }

}  // namespace

// mla_ops/ops/_paged.py: check_sinks
void check_sinks(std::string_view op, const std::optional<at::Tensor>& sinks, const at::Tensor& q,
                 std::string_view q_name) {
  if (!sinks.has_value()) return;
  check_float(op, "sinks", *sinks);
  check_rank(op, "sinks", *sinks, 1, "[heads] (one sink logit per head)");
  check_size(op, "sinks", sinks->size(0), q.size(1), std::string("length must equal the heads of ") +
                                                         std::string(q_name) + " (dim 1)");
  TORCH_CHECK(sinks->scalar_type() == at::kFloat || sinks->scalar_type() == q.scalar_type(), prefix(op),
              "sinks must be float32 or ", q_name, "'s dtype ", py_dtype(q), ", got ", py_dtype(*sinks));
}

// mla_ops/ops/_paged.py: check_q_scale
void check_q_scale(std::string_view op, const std::optional<at::Tensor>& q_scale, const at::Tensor& q) {
  if (!q_scale.has_value()) return;
  check_float(op, "q_scale", *q_scale);
  check_rank(op, "q_scale", *q_scale, 2, "[rows, heads] (one query scale per row and head)");
  check_size(op, "q_scale", q_scale->size(0), q.size(0), "rows (dim 0) must equal q_latent's");
  check_size(op, "q_scale", q_scale->size(1), q.size(1), "heads (dim 1) must equal q_latent's");
  TORCH_CHECK(q_scale->scalar_type() == at::kFloat || q_scale->scalar_type() == q.scalar_type(), prefix(op),
              "q_scale must be float32 or q_latent's dtype ", py_dtype(q), ", got ", py_dtype(*q_scale));
}

// mla_ops/ops/decode_attention.py: check_decode_attention_args
void check_decode_attention_args(const at::Tensor& q_latent, const at::Tensor& q_pe, const at::Tensor& key_cache,
                                 const at::Tensor& value_cache, const at::Tensor& block_tables,
                                 const at::Tensor& seq_lens, double softmax_scale,
                                 const std::optional<at::Tensor>& sinks, int64_t sliding_window,
                                 const std::optional<at::Tensor>& q_scale) {
  constexpr std::string_view op = "mla_decode_attention";
  check_softmax_scale(op, softmax_scale, " (e.g. qk_head_dim ** -0.5)");
  TORCH_CHECK(sliding_window >= 0, prefix(op), "sliding_window must be >= 0 (0: every cached token; W >= 1: the last "
              "W, the current one included), got ", sliding_window);
  check_latent_query_and_caches(op, "batch", q_latent, q_pe, key_cache, value_cache);
  check_index(op, "block_tables", block_tables);
  check_rank(op, "block_tables", block_tables, 2, "[batch, max_blocks_per_seq]");
  check_size(op, "block_tables", block_tables.size(0), q_latent.size(0), "rows must equal the batch size");
  check_index(op, "seq_lens", seq_lens);
  check_rank(op, "seq_lens", seq_lens, 1, "[batch]");
  check_size(op, "seq_lens", seq_lens.size(0), q_latent.size(0), "length must equal the batch size");
  check_sinks(op, sinks, q_latent, "q_latent");
  check_q_scale(op, q_scale, q_latent);
  check_same_device(op, {{"q_latent", &q_latent},
                         {"q_pe", &q_pe},
                         {"key_cache", &key_cache},
                         {"value_cache", &value_cache},
                         {"block_tables", &block_tables},
                         {"seq_lens", &seq_lens},
                         {"sinks", optional(sinks)},
                         {"q_scale", optional(q_scale)}});
}

// mla_ops/ops/kv_prolog.py: check_latent_kv_prolog_args
void check_latent_kv_prolog_args(const at::Tensor& hidden, const at::Tensor& kv_a_weight,
                                 const std::optional<at::Tensor>& kv_a_bias, const at::Tensor& kv_norm_weight,
                                 const at::Tensor& cos, const at::Tensor& sin, double eps,
                                 std::string_view rope_layout, std::string_view rope_compute_dtype) {
  check_stage1_args("latent_kv_prolog", hidden, kv_a_weight, kv_a_bias, kv_norm_weight, cos, sin, eps, rope_layout,
                    rope_compute_dtype);
}

// mla_ops/ops/kv_prolog.py: check_kv_prolog_args
void check_kv_prolog_args(const at::Tensor& hidden, const at::Tensor& kv_a_weight,
                          const std::optional<at::Tensor>& kv_a_bias, const at::Tensor& kv_norm_weight,
                          const at::Tensor& kv_b_weight, const at::Tensor& cos, const at::Tensor& sin,
                          int64_t num_heads, int64_t qk_nope_head_dim, int64_t v_head_dim, double eps,
                          std::string_view rope_layout, std::string_view rope_compute_dtype) {
  constexpr std::string_view op = "kv_prolog";
  check_stage1_args(op, hidden, kv_a_weight, kv_a_bias, kv_norm_weight, cos, sin, eps, rope_layout,
                    rope_compute_dtype);
  for (const auto& [name, value] : {std::pair<std::string_view, int64_t>{"num_heads", num_heads},
                                    {"qk_nope_head_dim", qk_nope_head_dim},
                                    {"v_head_dim", v_head_dim}}) {
    TORCH_CHECK(value > 0, prefix(op), name, " must be positive, got ", value);
  }
  check_rank(op, "kv_b_weight", kv_b_weight, 2, "[num_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]");
  check_same_dtype(op, "kv_b_weight", kv_b_weight, "hidden_states", hidden);
  // num_heads * (P + V) in 128 bits: huge head counts must be refused, never wrap into a match
  const __int128 rows = static_cast<__int128>(num_heads) * (static_cast<__int128>(qk_nope_head_dim) + v_head_dim);
  TORCH_CHECK(static_cast<__int128>(kv_b_weight.size(0)) == rows, prefix(op),
              "kv_b_weight rows must be num_heads * (qk_nope_head_dim + v_head_dim) = ", num_heads, " * (",
              qk_nope_head_dim, " + ", v_head_dim, "): expected ", py_int(rows), ", got ", kv_b_weight.size(0));
  check_size(op, "kv_b_weight", kv_b_weight.size(1), kv_norm_weight.size(0),
             "in_features (dim 1) must equal kv_lora_rank (the size of kv_norm_weight)");
  check_same_device(op, {{"hidden_states", &hidden}, {"kv_b_weight", &kv_b_weight}});
}

// mla_ops/ops/scatter_pa_kv_cache.py: check_scatter_pa_kv_cache_args
void check_scatter_pa_kv_cache_args(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                                    const at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  constexpr std::string_view op = "scatter_pa_kv_cache";
  check_cache_pair(op, key_cache, value_cache);
  check_token_tensor(op, "key", key, "key_cache", key_cache);
  check_token_tensor(op, "value", value, "value_cache", value_cache);
  check_size(op, "value", value.size(0), key.size(0), "token count (dim 0) must equal key's");
  check_index(op, "slot_mapping", slot_mapping);
  check_rank(op, "slot_mapping", slot_mapping, 1, "[tokens]");
  check_size(op, "slot_mapping", slot_mapping.size(0), key.size(0),
             "length must equal the token count of key (use a negative slot for padding tokens)");
  check_same_device(op, {{"key", &key},
                         {"value", &value},
                         {"key_cache", &key_cache},
                         {"value_cache", &value_cache},
                         {"slot_mapping", &slot_mapping}});
  check_writable_layout(op, "key_cache", key_cache);
  check_writable_layout(op, "value_cache", value_cache);
}

// mla_ops/ops/scatter_pa_kv_cache.py: check_scatter_pa_cache_args
void check_scatter_pa_cache_args(const at::Tensor& key, const at::Tensor& cache, const at::Tensor& slot_mapping) {
  constexpr std::string_view op = "scatter_pa_cache";
  check_rank(op, "cache", cache, 4, kCacheLayout);
  TORCH_CHECK(cache.size(0) >= 1, prefix(op), "cache needs at least one block (dim 0), got 0");
  TORCH_CHECK(cache.size(1) >= 1, prefix(op), "block_size (cache dim 1) must be >= 1, got 0");
  check_token_tensor(op, "key", key, "cache", cache);
  check_index(op, "slot_mapping", slot_mapping);
  check_rank(op, "slot_mapping", slot_mapping, 1, "[tokens]");
  check_size(op, "slot_mapping", slot_mapping.size(0), key.size(0),
             "length must equal the token count of key (use a negative slot for padding tokens)");
  check_same_device(op, {{"key", &key}, {"cache", &cache}, {"slot_mapping", &slot_mapping}});
  check_writable_layout(op, "cache", cache);
}

// mla_ops/ops/sparse_attention.py: check_lightning_indexer_args
void check_lightning_indexer_args(const at::Tensor& q, const at::Tensor& weights, const at::Tensor& k_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                  const at::Tensor& query_start_loc, int64_t topk, double softmax_scale,
                                  int64_t compress_ratio) {
  constexpr std::string_view op = "lightning_indexer";
  check_softmax_scale(op, softmax_scale);
  check_compress_ratio(op, compress_ratio);
  TORCH_CHECK(topk >= 1, prefix(op), "topk must be >= 1 (the number of positions kept per query token), got ", topk);
  check_float(op, "q", q);
  check_rank(op, "q", q, 3, "[tokens, index_heads, index_head_dim] (rotated indexer queries)");
  check_float(op, "weights", weights);
  check_rank(op, "weights", weights, 2, "[tokens, index_heads]");
  TORCH_CHECK(weights.scalar_type() == at::kFloat || weights.scalar_type() == q.scalar_type(), prefix(op),
              "weights must be float32 or q's dtype ", py_dtype(q), ", got ", py_dtype(weights));
  check_size(op, "weights", weights.size(0), q.size(0), "tokens (dim 0) must equal q's");
  check_size(op, "weights", weights.size(1), q.size(1), "heads (dim 1) must equal q's index heads");
  check_rank(op, "k_cache", k_cache, 4, "[num_blocks, block_size, 1, index_head_dim]");
  check_size(op, "k_cache", k_cache.size(2), 1, "heads (dim 2) must be 1: the indexer caches one key per token");
  check_size(op, "k_cache", k_cache.size(3), q.size(2), "dim (dim 3) must equal index_head_dim, q's last dim");
  TORCH_CHECK(k_cache.size(0) >= 1, prefix(op), "k_cache needs at least one block (dim 0), got 0");
  TORCH_CHECK(k_cache.size(1) >= 1, prefix(op), "block_size (k_cache dim 1) must be >= 1, got 0");
  check_same_dtype(op, "k_cache", k_cache, "q", q);
  check_requests(op, block_tables, seq_lens, query_start_loc);
  check_same_device(op, {{"q", &q},
                         {"weights", &weights},
                         {"k_cache", &k_cache},
                         {"block_tables", &block_tables},
                         {"seq_lens", &seq_lens},
                         {"query_start_loc", &query_start_loc}});
}

// mla_ops/ops/sparse_attention.py: check_sparse_mla_attention_args
void check_sparse_mla_attention_args(const at::Tensor& q_latent, const at::Tensor& q_pe, const at::Tensor& key_cache,
                                     const at::Tensor& value_cache, const at::Tensor& block_tables,
                                     const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                                     const at::Tensor& topk_indices, double softmax_scale,
                                     const std::optional<at::Tensor>& sinks, const std::optional<at::Tensor>& q_scale) {
  constexpr std::string_view op = "sparse_mla_attention";
  check_softmax_scale(op, softmax_scale);
  check_latent_query_and_caches(op, "tokens", q_latent, q_pe, key_cache, value_cache);
  check_requests(op, block_tables, seq_lens, query_start_loc);
  check_index(op, "topk_indices", topk_indices);
  check_rank(op, "topk_indices", topk_indices, 2, "[tokens, topk] (request-local positions, -1 = none)");
  check_size(op, "topk_indices", topk_indices.size(0), q_latent.size(0), "tokens (dim 0) must equal q_latent's");
  check_sinks(op, sinks, q_latent, "q_latent");
  check_q_scale(op, q_scale, q_latent);
  check_same_device(op, {{"q_latent", &q_latent},
                         {"q_pe", &q_pe},
                         {"key_cache", &key_cache},
                         {"value_cache", &value_cache},
                         {"block_tables", &block_tables},
                         {"seq_lens", &seq_lens},
                         {"query_start_loc", &query_start_loc},
                         {"topk_indices", &topk_indices},
                         {"sinks", optional(sinks)},
                         {"q_scale", optional(q_scale)}});
}

// mla_ops/ops/mla_prefill_attention.py: check_mla_prefill_attention_args
void check_mla_prefill_attention_args(const at::Tensor& q_latent, const at::Tensor& q_pe, const at::Tensor& key_cache,
                                      const at::Tensor& value_cache, const at::Tensor& block_tables,
                                      const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                                      double softmax_scale) {
  constexpr std::string_view op = "mla_prefill_attention";
  check_softmax_scale(op, softmax_scale, " (e.g. qk_head_dim ** -0.5)");
  check_latent_query_and_caches(op, "tokens", q_latent, q_pe, key_cache, value_cache);
  check_requests(op, block_tables, seq_lens, query_start_loc);
  check_same_device(op, {{"q_latent", &q_latent},
                         {"q_pe", &q_pe},
                         {"key_cache", &key_cache},
                         {"value_cache", &value_cache},
                         {"block_tables", &block_tables},
                         {"seq_lens", &seq_lens},
                         {"query_start_loc", &query_start_loc}});
}

// mla_ops/ops/mha_prefill_attention.py: check_mha_prefill_attention_args
void check_mha_prefill_attention_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const at::Tensor& query_start_loc, const at::Tensor& key_start_loc,
                                      double softmax_scale) {
  constexpr std::string_view op = "mha_prefill_attention";
  check_softmax_scale(op, softmax_scale, " (e.g. qk_head_dim ** -0.5)");
  check_float(op, "q", q);
  check_rank(op, "q", q, 3, "[tokens, heads, qk_head_dim]");
  TORCH_CHECK(q.size(2) >= 1, prefix(op), "q head dim (dim 2) must be >= 1, got 0");
  check_rank(op, "k", k, 3, "[keys, heads, qk_head_dim]");
  check_same_dtype(op, "k", k, "q", q);
  check_size(op, "k", k.size(1), q.size(1), "heads (dim 1) must equal q's");
  check_size(op, "k", k.size(2), q.size(2), "head dim (dim 2) must equal q's qk_head_dim");
  check_rank(op, "v", v, 3, "[keys, heads, v_head_dim]");
  check_same_dtype(op, "v", v, "q", q);
  check_size(op, "v", v.size(0), k.size(0), "keys (dim 0) must equal k's");
  check_size(op, "v", v.size(1), q.size(1), "heads (dim 1) must equal q's");
  TORCH_CHECK(v.size(2) >= 1, prefix(op), "v head dim (dim 2) must be >= 1, got 0");
  check_index(op, "query_start_loc", query_start_loc);
  check_rank(op, "query_start_loc", query_start_loc, 1, "[batch + 1] (cumulative query tokens per request)");
  check_index(op, "key_start_loc", key_start_loc);
  check_rank(op, "key_start_loc", key_start_loc, 1, "[batch + 1] (cumulative keys per request)");
  check_size(op, "key_start_loc", key_start_loc.size(0), query_start_loc.size(0),
             "length must equal query_start_loc's (one entry per request plus one)");
  TORCH_CHECK(query_start_loc.size(0) >= 1, prefix(op),
              "query_start_loc must have one entry per request plus one (cumulative counts starting at 0), got an "
              "empty tensor");
  check_same_device(op, {{"q", &q},
                         {"k", &k},
                         {"v", &v},
                         {"query_start_loc", &query_start_loc},
                         {"key_start_loc", &key_start_loc}});
}

// mla_ops/ops/shared_kv_attention.py: check_shared_kv_attention_args
void check_shared_kv_attention_args(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                                    const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                                    const std::optional<at::Tensor>& sinks, double softmax_scale,
                                    int64_t sliding_window, const std::optional<at::Tensor>& compressed_cache,
                                    const std::optional<at::Tensor>& compressed_block_tables, int64_t compress_ratio,
                                    const std::optional<at::Tensor>& topk_indices) {
  constexpr std::string_view op = "shared_kv_attention";
  check_softmax_scale(op, softmax_scale, " (e.g. head_dim ** -0.5)");
  TORCH_CHECK(sliding_window >= 1, prefix(op),
              "sliding_window must be >= 1 (the window rows a token sees, itself included), got ", sliding_window);
  check_compress_ratio(op, compress_ratio);
  check_float(op, "q", q);
  check_rank(op, "q", q, 3, "[tokens, heads, head_dim] (normed, rotated queries)");
  check_shared_pool(op, "kv_cache", kv_cache, q, "the window rows, one per token");
  check_requests(op, block_tables, seq_lens, query_start_loc);
  check_sinks(op, sinks, q, "q");
  if (!compressed_cache.has_value()) {
    TORCH_CHECK(!compressed_block_tables.has_value(), prefix(op),
                "compressed_block_tables was given without compressed_cache; pass both (the compressor's entry pool "
                "and its block tables) or neither");
    TORCH_CHECK(!topk_indices.has_value(), prefix(op),
                "topk_indices lists compressed entries, but compressed_cache is None; pass compressed_cache and "
                "compressed_block_tables with it");
  } else {
    TORCH_CHECK(compressed_block_tables.has_value(), prefix(op),
                "compressed_cache was given without compressed_block_tables; pass its block tables [batch, "
                "max_entry_blocks]");
    check_shared_pool(op, "compressed_cache", *compressed_cache, q,
                      "the compressor's entries, one per compress_ratio tokens");
    check_index(op, "compressed_block_tables", *compressed_block_tables);
    check_rank(op, "compressed_block_tables", *compressed_block_tables, 2, "[batch, max_entry_blocks]");
    check_size(op, "compressed_block_tables", compressed_block_tables->size(0), block_tables.size(0),
               "rows must equal block_tables' (one per request)");
    if (topk_indices.has_value()) {
      check_index(op, "topk_indices", *topk_indices);
      check_rank(op, "topk_indices", *topk_indices, 2,
                 "[tokens, topk] (request-local compressed entry indices, -1 = none)");
      check_size(op, "topk_indices", topk_indices->size(0), q.size(0), "tokens (dim 0) must equal q's");
    }
  }
  check_same_device(op, {{"q", &q},
                         {"kv_cache", &kv_cache},
                         {"block_tables", &block_tables},
                         {"seq_lens", &seq_lens},
                         {"query_start_loc", &query_start_loc},
                         {"sinks", optional(sinks)},
                         {"compressed_cache", optional(compressed_cache)},
                         {"compressed_block_tables", optional(compressed_block_tables)},
                         {"topk_indices", optional(topk_indices)}});
}

// mla_ops/ops/shared_kv_prolog.py: check_shared_kv_q_prolog_args
void check_shared_kv_q_prolog_args(const at::Tensor& hidden, const at::Tensor& q_a_weight,
                                   const at::Tensor& q_norm_weight, const at::Tensor& q_b_weight, const at::Tensor& cos,
                                   const at::Tensor& sin, int64_t num_heads, double eps) {
  constexpr std::string_view op = "shared_kv_q_prolog";
  TORCH_CHECK(num_heads > 0, prefix(op), "num_heads must be positive, got ", num_heads);
  TORCH_CHECK(eps >= 0.0, prefix(op), "eps must be >= 0, got ", py_float(eps));
  check_hidden_and_projection(op, hidden, "q_a_weight", q_a_weight, "[q_lora_rank, hidden] (q_a_proj.weight)");
  check_norm_weight(op, "q_norm_weight", q_norm_weight, q_a_weight.size(0), "q_lora_rank (the rows of q_a_weight)",
                    hidden, "hidden_states");
  check_rank(op, "q_b_weight", q_b_weight, 2, "[num_heads * head_dim, q_lora_rank] (q_b_proj.weight)");
  check_same_dtype(op, "q_b_weight", q_b_weight, "hidden_states", hidden);
  check_size(op, "q_b_weight", q_b_weight.size(1), q_a_weight.size(0),
             "in_features (dim 1) must equal q_lora_rank (the rows of q_a_weight)");
  TORCH_CHECK(q_b_weight.size(0) % num_heads == 0, prefix(op), "q_b_weight has ", q_b_weight.size(0),
              " rows, which must be num_heads (", num_heads,
              ") * head_dim; pass the num_heads of the attention (config.num_attention_heads)");
  TORCH_CHECK(cos.dim() == 2 || cos.dim() == 3, prefix(op), "cos must be [B, S, R/2] or [S, R/2], got ", py_shape(cos));
  check_rope_width(op, "cos", cos, q_b_weight.size(0) / num_heads, "head_dim (q_b_weight rows / num_heads)");
  check_rope_tables(op, "q", cos, sin, 2 * cos.size(-1), hidden.size(1), hidden.size(0));
  check_same_device(op, {{"hidden_states", &hidden},
                         {"q_a_weight", &q_a_weight},
                         {"q_norm_weight", &q_norm_weight},
                         {"q_b_weight", &q_b_weight},
                         {"cos", &cos},
                         {"sin", &sin}});
}

// mla_ops/ops/shared_kv_prolog.py: check_shared_kv_prolog_args
void check_shared_kv_prolog_args(const at::Tensor& hidden, const at::Tensor& kv_weight,
                                 const at::Tensor& kv_norm_weight, const at::Tensor& cos, const at::Tensor& sin,
                                 double eps) {
  constexpr std::string_view op = "shared_kv_prolog";
  TORCH_CHECK(eps >= 0.0, prefix(op), "eps must be >= 0, got ", py_float(eps));
  check_hidden_and_projection(op, hidden, "kv_weight", kv_weight, "[head_dim, hidden] (kv_proj.weight)");
  check_norm_weight(op, "kv_norm_weight", kv_norm_weight, kv_weight.size(0), "head_dim (the rows of kv_weight)", hidden,
                    "hidden_states");
  TORCH_CHECK(cos.dim() == 2 || cos.dim() == 3, prefix(op), "cos must be [B, S, R/2] or [S, R/2], got ", py_shape(cos));
  check_rope_width(op, "cos", cos, kv_weight.size(0), "head_dim (the rows of kv_weight)");
  check_rope_tables(op, "kv", cos, sin, 2 * cos.size(-1), hidden.size(1), hidden.size(0));
  check_same_device(op, {{"hidden_states", &hidden},
                         {"kv_weight", &kv_weight},
                         {"kv_norm_weight", &kv_norm_weight},
                         {"cos", &cos},
                         {"sin", &sin}});
}

// mla_ops/ops/kv_compressor.py: check_kv_compressor_args
void check_kv_compressor_args(const at::Tensor& kv, const at::Tensor& gate, const at::Tensor& position_bias,
                              const at::Tensor& norm_weight, const at::Tensor& cos_cache, const at::Tensor& sin_cache,
                              const at::Tensor& state, const at::Tensor& entry_cache, const at::Tensor& block_tables,
                              const at::Tensor& seq_lens, const at::Tensor& query_start_loc, int64_t compress_ratio,
                              bool overlap, double eps) {
  constexpr std::string_view op = "kv_compressor";
  check_compress_ratio(op, compress_ratio);
  TORCH_CHECK(eps >= 0.0, prefix(op), "eps must be >= 0, got ", py_float(eps));
  check_rank(op, "norm_weight", norm_weight, 1, "[head_dim] (kv_norm.weight of the compressor)");
  const int64_t head_dim = norm_weight.size(0);
  const __int128 channels = overlap ? 2 * static_cast<__int128>(head_dim) : head_dim;
  const std::string_view series = overlap ? "2 * head_dim with overlap=True (CSA: two series, Ca and Cb)"
                                          : "head_dim with overlap=False (HCA)";
  check_float(op, "kv", kv);
  check_rank(op, "kv", kv, 2, "[tokens, channels] (kv_proj output of the new tokens)");
  check_size_wide(op, "kv", kv.size(1), channels,
                  "channels (dim 1) must be " + std::string(series) + "; head_dim is the length of norm_weight");
  check_rank(op, "gate", gate, 2, "[tokens, channels] (gate_proj output of the new tokens)");
  check_size(op, "gate", gate.size(0), kv.size(0), "tokens (dim 0) must equal kv's");
  check_size(op, "gate", gate.size(1), kv.size(1), "channels (dim 1) must equal kv's");
  check_same_dtype(op, "gate", gate, "kv", kv);
  check_norm_weight(op, "norm_weight", norm_weight, head_dim, "head_dim", kv, "kv");
  check_rank(op, "position_bias", position_bias, 2, "[compress_ratio, channels]");
  check_size(op, "position_bias", position_bias.size(0), compress_ratio,
             "rows (dim 0) must equal compress_ratio (one bias row per slot of a window)");
  check_size(op, "position_bias", position_bias.size(1), kv.size(1), "channels (dim 1) must equal kv's");
  TORCH_CHECK(position_bias.scalar_type() == at::kFloat || position_bias.scalar_type() == kv.scalar_type(), prefix(op),
              "position_bias must be float32 (stock keeps it in fp32) or kv's dtype ", py_dtype(kv), ", got ",
              py_dtype(position_bias));
  for (const auto& [name, table] : {NamedTensor{"cos_cache", &cos_cache}, NamedTensor{"sin_cache", &sin_cache}}) {
    check_float(op, name, *table);
    check_rank(op, name, *table, 2, "[positions, rope_dim / 2] (the rope table by position)");
  }
  TORCH_CHECK(cos_cache.sizes() == sin_cache.sizes(), prefix(op), "cos_cache and sin_cache must have the same shape, got ",
              py_shape(cos_cache), " and ", py_shape(sin_cache));
  TORCH_CHECK(cos_cache.size(0) >= 1, prefix(op),
              "cos_cache has no position (dim 0 is 0); pass the rope table of every position an entry is rotated at "
              "(w * compress_ratio)");
  check_rope_width(op, "cos_cache", cos_cache, head_dim, "head_dim (the length of norm_weight)");
  check_requests(op, block_tables, seq_lens, query_start_loc);
  const __int128 rows = overlap ? 2 * static_cast<__int128>(compress_ratio) : compress_ratio;
  check_rank(op, "state", state, 4, "[batch, rows, 2, channels] (raw kv and gate of each request's latest tokens)");
  check_size(op, "state", state.size(0), block_tables.size(0),
             "batch (dim 0) must equal the number of block-table rows (one per request)");
  check_size_wide(op, "state", state.size(1), rows,
                  std::string("rows (dim 1) must be ") + (overlap ? "2 * " : "") + "compress_ratio with overlap=" +
                      (overlap ? "True" : "False"));
  check_size(op, "state", state.size(2), 2, "dim 2 must be 2 (index 0: raw kv, index 1: raw gate)");
  check_size(op, "state", state.size(3), kv.size(1), "channels (dim 3) must equal kv's");
  check_same_dtype(op, "state", state, "kv", kv);
  check_writable_layout(op, "state", state);
  check_rank(op, "entry_cache", entry_cache, 4, "[num_blocks, block_size, 1, head_dim] (the compressed entries)");
  check_size(op, "entry_cache", entry_cache.size(2), 1, "heads (dim 2) must be 1: one entry row per window");
  check_size(op, "entry_cache", entry_cache.size(3), head_dim,
             "dim (dim 3) must equal head_dim (the length of norm_weight)");
  TORCH_CHECK(entry_cache.size(0) >= 1, prefix(op), "entry_cache needs at least one block (dim 0), got 0");
  TORCH_CHECK(entry_cache.size(1) >= 1, prefix(op), "block_size (entry_cache dim 1) must be >= 1, got 0");
  check_same_dtype(op, "entry_cache", entry_cache, "kv", kv);
  check_writable_layout(op, "entry_cache", entry_cache);
  check_same_device(op, {{"kv", &kv},
                         {"gate", &gate},
                         {"position_bias", &position_bias},
                         {"norm_weight", &norm_weight},
                         {"cos_cache", &cos_cache},
                         {"sin_cache", &sin_cache},
                         {"state", &state},
                         {"entry_cache", &entry_cache},
                         {"block_tables", &block_tables},
                         {"seq_lens", &seq_lens},
                         {"query_start_loc", &query_start_loc}});
}

// mla_ops/ops/rms_norm.py: check_rms_norm_args
void check_rms_norm_args(const at::Tensor& x, const at::Tensor& weight, double eps) {
  constexpr std::string_view op = "rms_norm";
  check_float(op, "x", x);
  check_float(op, "weight", weight);
  TORCH_CHECK(x.dim() >= 1, prefix(op), "x must have at least one dim [..., H], got a scalar");
  check_rank(op, "weight", weight, 1, "[H]");
  check_size(op, "weight", weight.size(0), x.size(-1), "length must equal the last dim of x");
  check_same_device(op, {{"x", &x}, {"weight", &weight}});
  TORCH_CHECK(eps >= 0.0, prefix(op), "eps must be >= 0, got ", py_float(eps));
}

// mla_ops/ops/gather_pa_kv_cache.py: check_gather_pa_kv_cache_args
void check_gather_pa_kv_cache_args(const at::Tensor& key_cache, const at::Tensor& value_cache,
                                   const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& key,
                                   const at::Tensor& value, const std::optional<at::Tensor>& seq_offset,
                                   bool is_seq_lens_cumsum) {
  check_gather_args("gather_pa_kv_cache", key_cache, value_cache, block_tables, seq_lens, key, value, seq_offset,
                    is_seq_lens_cumsum, /*writes_outputs=*/true);
}

// mla_ops/ops/gather_pa_kv_cache.py: check_gather_pa_kv_cache_functional_args
void check_gather_pa_kv_cache_functional_args(const at::Tensor& key_cache, const at::Tensor& value_cache,
                                              const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                              const at::Tensor& key, const at::Tensor& value,
                                              const std::optional<at::Tensor>& seq_offset, bool is_seq_lens_cumsum) {
  check_gather_args("gather_pa_kv_cache_functional", key_cache, value_cache, block_tables, seq_lens, key, value,
                    seq_offset, is_seq_lens_cumsum, /*writes_outputs=*/false);
}

}  // namespace mla_native
