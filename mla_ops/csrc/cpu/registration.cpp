// The native kernels on the dispatcher: `torch.ops.mla.<op>` on CPU tensors reaches them without a
// Python frame.
//
// For every op the backend layer binds here (`bind`, called from mla_ops/backends), two kernels:
// * CPU: the op's metadata check (arguments.cpp), then this backend's reasons for not serving the call
//   (dtype, layouts: `*_reasons` below, also what `mla_ops.explain` prints), then the kernel, whose
//   own value checks run before it writes anything. A call the kernel cannot serve goes to the
//   reference kernel (the op's CompositeExplicitAutograd registration) under the automatic choice, or
//   is refused with NotImplementedError when this backend was requested by name.
// * AutogradCPU: when no input needs a gradient (the inference path), straight below autograd to the
//   CPU kernel, bumping the version of the tensors the op writes; otherwise the op's own Autograd
//   registration (Python: the backward formula, or the refusal of an inference-only op) takes the call.
//
// The registrations are made at run time (not with static TORCH_LIBRARY_IMPL blocks) so that one of
// the ISA builds, chosen when binding, serves the ops even when several are loaded, and so that
// changing the backend setting can remove them (`unbind`). Fakes and schemas stay in Python.
#include "checks.h"
#include "common.h"
#include "ops.h"
#include "registration.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/grad_mode.h>
#include <ATen/core/boxing/impl/boxing.h>
#include <ATen/core/stack.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <array>
#include <memory>
#include <string>
#include <vector>

namespace mla_native {
inline namespace CPU_CAPABILITY {

// ----------------------------------------------------------------------------------- reasons
namespace {

bool native_dtype(const at::Tensor& t) {
  const auto d = t.scalar_type();
  return d == at::kFloat || d == at::kBFloat16 || d == at::kHalf;
}

void add_dtype_reason(Reasons& reasons, const at::Tensor& activation) {
  if (!native_dtype(activation)) {
    reasons.push_back(py_dtype(activation) +
                      " is not served by the native kernels (float32, bfloat16, float16); the reference kernel "
                      "serves it");
  }
}

// Whether a [.., S, R/2] table steps through pairs no slower than through positions.
bool position_major(const at::Tensor& t) {
  return t.dim() < 2 || t.size(-1) <= 1 || t.size(-2) <= 1 || t.stride(-1) <= t.stride(-2);
}

}  // namespace

Reasons prolog_reasons(const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin,
                       std::string_view rope_layout, std::string_view rope_compute_dtype) {
  Reasons reasons;
  add_dtype_reason(reasons, hidden);
  if (rope_compute_dtype == "activation" && hidden.scalar_type() != at::kFloat) {
    // In fp32 the kernel's separately rounded fp32 products and sums (-ffp-contract=off) are the
    // "activation" formula itself; in fp16 / bf16 that formula rounds every step to the half type.
    const std::string dtype = py_dtype(hidden);
    reasons.push_back("rope_compute_dtype 'activation' with " + dtype +
                      ": the native prolog kernels rotate k_pe in fp32 and round once; the reference kernel rounds "
                      "each product and sum to " +
                      dtype + " as the stock x*cos + rotate_half(x)*sin does");
  }
  if (!(position_major(cos) && position_major(sin))) {
    // transformers 4.54 - 5.1x build DeepSeek-V2's rotary tables transposed; ATen's complex multiply
    // over such a layout (the stock model's RoPE, and the reference kernel's) takes a loop whose
    // rounding the vectorised native formula does not reproduce
    reasons.push_back(
        "cos/sin are laid out pair-major (the rotary tables of a transposed freqs tensor); the reference kernel "
        "reproduces transformers' rounding for them");
  }
  if (rope_layout != "interleaved" && rope_layout != "half") {
    reasons.push_back("rope_layout " + py_repr(rope_layout) +
                      ": the native prolog kernels rotate adjacent pairs (interleaved or half); the reference "
                      "kernel serves it");
  }
  return reasons;
}

namespace {

// The attention kernels (decode and sparse: one kernel, decode_attention.cpp) read cached rows in place.
Reasons attention_reasons(const at::Tensor& q_latent, const at::Tensor& key_cache, const at::Tensor& value_cache,
                          std::string_view kernel) {
  Reasons reasons;
  add_dtype_reason(reasons, q_latent);
  if (key_cache.stride(3) != 1 || value_cache.stride(3) != 1) {
    reasons.push_back("the caches' last dim must be unit-stride for the native " + std::string(kernel) + " kernel");
  }
  return reasons;
}

}  // namespace

Reasons decode_reasons(const at::Tensor& q_latent, const at::Tensor& key_cache, const at::Tensor& value_cache) {
  return attention_reasons(q_latent, key_cache, value_cache, "decode");
}

Reasons sparse_attention_reasons(const at::Tensor& q_latent, const at::Tensor& key_cache,
                                 const at::Tensor& value_cache) {
  return attention_reasons(q_latent, key_cache, value_cache, "sparse attention");
}

Reasons indexer_reasons(const at::Tensor& q) {
  Reasons reasons;
  add_dtype_reason(reasons, q);
  return reasons;
}

// --------------------------------------------------------------------------------- binding state
namespace {

enum BoundOp : size_t {
  kDecode,
  kKvProlog,
  kLatentKvProlog,
  kGather,
  kGatherFunctional,
  kScatter,
  kScatterOnePool,
  kIndexer,
  kSparseAttention,
  kNumOps
};

constexpr std::array<const char*, kNumOps> kOpNames = {
    "mla_decode_attention", "kv_prolog",         "latent_kv_prolog",
    "gather_pa_kv_cache",   "gather_pa_kv_cache_functional",
    "scatter_pa_kv_cache",  "scatter_pa_cache",  "lightning_indexer",
    "sparse_mla_attention"};

struct OpBinding {
  bool demand = false;         // this backend was requested by name: refuse what it cannot serve
  std::string refusal_head;    // NotImplementedError text: head + "; ".join(reasons) + tail
  std::string refusal_tail;
};

std::array<OpBinding, kNumOps> g_bindings;
std::unique_ptr<torch::Library> g_cpu_library;
std::unique_ptr<torch::Library> g_autograd_library;

std::string joined(const Reasons& reasons) {
  std::string out;
  for (size_t i = 0; i < reasons.size(); ++i) out += (i ? "; " : "") + reasons[i];
  return out;
}

template <typename T>
c10::IValue boxed(T&& value) {
  if constexpr (std::is_same_v<std::decay_t<T>, std::string_view>) {
    return c10::IValue(std::string(value));
  } else {
    return c10::IValue(std::forward<T>(value));
  }
}

// Who is calling: the dispatcher (the op bound to this build) or a direct call of this build's module
// (the caller chose the build, so nothing is handed on).
enum class Caller { kDispatcher, kDirect };

// A call the native kernel cannot serve. Direct calls are refused; through the dispatcher the reference
// kernel takes it (automatic choice), or it is refused with the backend layer's text (this backend
// requested by name).
template <Caller caller, typename Result, typename... Args>
Result not_served(BoundOp op, const Reasons& reasons, Args&&... args) {
  if constexpr (caller == Caller::kDirect) {
    TORCH_CHECK_NOT_IMPLEMENTED(false, "mla.", kOpNames[op], ": the native kernel cannot serve this call: ",
                                joined(reasons));
  }
  const OpBinding& binding = g_bindings[op];
  TORCH_CHECK_NOT_IMPLEMENTED(!binding.demand, binding.refusal_head, joined(reasons), binding.refusal_tail);
  static thread_local std::array<std::optional<c10::OperatorHandle>, kNumOps> handles;
  if (!handles[op]) handles[op] = c10::Dispatcher::singleton().findSchemaOrThrow(
                        (std::string("mla::") + kOpNames[op]).c_str(), "");
  torch::jit::Stack stack;
  stack.reserve(sizeof...(Args));
  (stack.push_back(boxed(std::forward<Args>(args))), ...);
  handles[op]->callBoxedForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd, stack);
  if constexpr (!std::is_void_v<Result>) return c10::impl::PopResult<Result>::call(stack);
}

// ------------------------------------------------------------------- the ops: checks, reasons, kernel
template <Caller caller>
at::Tensor serve_decode(const at::Tensor& q_latent, const at::Tensor& q_pe, const at::Tensor& key_cache,
                        const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                        double softmax_scale, bool validate_values = true) {
  check_decode_attention_args(q_latent, q_pe, key_cache, value_cache, block_tables, seq_lens, softmax_scale);
  const Reasons reasons = decode_reasons(q_latent, key_cache, value_cache);
  if (!reasons.empty()) {
    return not_served<caller, at::Tensor>(kDecode, reasons, q_latent, q_pe, key_cache, value_cache, block_tables,
                                          seq_lens, softmax_scale);
  }
  return decode_attention(q_latent, q_pe, key_cache, value_cache, block_tables, seq_lens, softmax_scale,
                          validate_values);
}

template <Caller caller>
std::tuple<at::Tensor, at::Tensor, at::Tensor> serve_kv_prolog(
    const at::Tensor& hidden, const at::Tensor& kv_a_weight, const std::optional<at::Tensor>& kv_a_bias,
    const at::Tensor& kv_norm_weight, const at::Tensor& kv_b_weight, const at::Tensor& cos, const at::Tensor& sin,
    int64_t num_heads, int64_t qk_nope_head_dim, int64_t v_head_dim, double eps, c10::string_view rope_layout,
    c10::string_view rope_compute_dtype) {
  check_kv_prolog_args(hidden, kv_a_weight, kv_a_bias, kv_norm_weight, kv_b_weight, cos, sin, num_heads,
                       qk_nope_head_dim, v_head_dim, eps, rope_layout, rope_compute_dtype);
  const Reasons reasons = prolog_reasons(hidden, cos, sin, rope_layout, rope_compute_dtype);
  if (!reasons.empty()) {
    return not_served<caller, std::tuple<at::Tensor, at::Tensor, at::Tensor>>(
        kKvProlog, reasons, hidden, kv_a_weight, kv_a_bias, kv_norm_weight, kv_b_weight, cos, sin, num_heads,
        qk_nope_head_dim, v_head_dim, eps, std::string_view(rope_layout), std::string_view(rope_compute_dtype));
  }
  return kv_prolog(hidden, kv_a_weight, kv_a_bias, kv_norm_weight, kv_b_weight, cos, sin, num_heads, qk_nope_head_dim,
                   v_head_dim, eps, rope_layout == "interleaved");
}

template <Caller caller>
std::tuple<at::Tensor, at::Tensor> serve_latent_kv_prolog(const at::Tensor& hidden, const at::Tensor& kv_a_weight,
                                                          const std::optional<at::Tensor>& kv_a_bias,
                                                          const at::Tensor& kv_norm_weight, const at::Tensor& cos,
                                                          const at::Tensor& sin, double eps,
                                                          c10::string_view rope_layout,
                                                          c10::string_view rope_compute_dtype) {
  check_latent_kv_prolog_args(hidden, kv_a_weight, kv_a_bias, kv_norm_weight, cos, sin, eps, rope_layout,
                              rope_compute_dtype);
  const Reasons reasons = prolog_reasons(hidden, cos, sin, rope_layout, rope_compute_dtype);
  if (!reasons.empty()) {
    return not_served<caller, std::tuple<at::Tensor, at::Tensor>>(
        kLatentKvProlog, reasons, hidden, kv_a_weight, kv_a_bias, kv_norm_weight, cos, sin, eps,
        std::string_view(rope_layout), std::string_view(rope_compute_dtype));
  }
  return latent_kv_prolog(hidden, kv_a_weight, kv_a_bias, kv_norm_weight, cos, sin, eps, rope_layout == "interleaved");
}

template <Caller caller>
at::Tensor serve_lightning_indexer(const at::Tensor& q, const at::Tensor& weights, const at::Tensor& k_cache,
                                   const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                   const at::Tensor& query_start_loc, int64_t topk, double softmax_scale) {
  check_lightning_indexer_args(q, weights, k_cache, block_tables, seq_lens, query_start_loc, topk, softmax_scale);
  const Reasons reasons = indexer_reasons(q);
  if (!reasons.empty()) {
    return not_served<caller, at::Tensor>(kIndexer, reasons, q, weights, k_cache, block_tables, seq_lens,
                                          query_start_loc, topk, softmax_scale);
  }
  return lightning_indexer(q, weights, k_cache, block_tables, seq_lens, query_start_loc, topk, softmax_scale);
}

template <Caller caller>
at::Tensor serve_sparse_mla_attention(const at::Tensor& q_latent, const at::Tensor& q_pe,
                                      const at::Tensor& key_cache, const at::Tensor& value_cache,
                                      const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                      const at::Tensor& query_start_loc, const at::Tensor& topk_indices,
                                      double softmax_scale) {
  check_sparse_mla_attention_args(q_latent, q_pe, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                                  topk_indices, softmax_scale);
  const Reasons reasons = sparse_attention_reasons(q_latent, key_cache, value_cache);
  if (!reasons.empty()) {
    return not_served<caller, at::Tensor>(kSparseAttention, reasons, q_latent, q_pe, key_cache, value_cache,
                                          block_tables, seq_lens, query_start_loc, topk_indices, softmax_scale);
  }
  return sparse_mla_attention(q_latent, q_pe, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                              topk_indices, softmax_scale);
}

// ----------------------------------------------------------------------------- CPU-key kernels
namespace {
// t.clone(): a tensor with row-major strides by one memcpy into a tensor from the CPU allocator (clone's
// copy_ is a TensorIterator pass and two dispatcher trips, most of a small gather's cost); any other
// layout (size-1 dims with other strides included: clone keeps them) by clone.
at::Tensor clone_strided(const at::Tensor& t) {
  if (!t.is_contiguous()) return t.clone();
  at::Tensor out = new_cpu_tensor(t.sizes(), t.scalar_type());
  if (out.strides() != t.strides()) return t.clone();
  if (t.numel() > 0) std::memcpy(out.data_ptr(), t.const_data_ptr(), t.nbytes());
  return out;
}
}  // namespace

// (the schema's signatures; gather and scatter have no reasons, so the direct calls are the same)
at::Tensor decode_cpu(const at::Tensor& q_latent, const at::Tensor& q_pe, const at::Tensor& key_cache,
                      const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                      double softmax_scale) {
  return serve_decode<Caller::kDispatcher>(q_latent, q_pe, key_cache, value_cache, block_tables, seq_lens,
                                           softmax_scale);
}

void gather_cpu(const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& block_tables,
                const at::Tensor& seq_lens, const at::Tensor& key, const at::Tensor& value,
                const std::optional<at::Tensor>& seq_offset, bool is_seq_lens_cumsum) {
  check_gather_pa_kv_cache_args(key_cache, value_cache, block_tables, seq_lens, key, value, seq_offset,
                                is_seq_lens_cumsum, /*functional=*/false);
  gather_pa_kv_cache(key_cache, value_cache, block_tables, seq_lens, key, value, seq_offset, is_seq_lens_cumsum);
}

std::tuple<at::Tensor, at::Tensor> gather_functional_cpu(const at::Tensor& key_cache, const at::Tensor& value_cache,
                                                         const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                                         const at::Tensor& key, const at::Tensor& value,
                                                         const std::optional<at::Tensor>& seq_offset,
                                                         bool is_seq_lens_cumsum) {
  check_gather_pa_kv_cache_args(key_cache, value_cache, block_tables, seq_lens, key, value, seq_offset,
                                is_seq_lens_cumsum, /*functional=*/true);
  // clones keep key's / value's strides (the fake kernel promises empty_like's layout)
  at::Tensor key_out = clone_strided(key), value_out = clone_strided(value);
  // the value checks are the in-place op's, and name it (as the reference's functional twin does)
  gather_pa_kv_cache(key_cache, value_cache, block_tables, seq_lens, key_out, value_out, seq_offset, is_seq_lens_cumsum);
  return {key_out, value_out};
}

void scatter_cpu(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                 const at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  check_scatter_pa_kv_cache_args(key, value, key_cache, value_cache, slot_mapping);
  scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping);
}

void scatter_one_pool_cpu(const at::Tensor& key, const at::Tensor& cache, const at::Tensor& slot_mapping) {
  check_scatter_pa_cache_args(key, cache, slot_mapping);
  scatter_pa_cache(key, cache, slot_mapping);
}

// -------------------------------------------------------------------------- AutogradCPU kernel
// The inference path skips the Python autograd kernel: with grad mode off, or no input requiring a
// gradient, nothing needs recording. Otherwise the op's own Autograd registration serves the call.
void autograd_cpu(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const auto& arguments = op.schema().arguments();
  const auto first = stack->end() - static_cast<std::ptrdiff_t>(arguments.size());
  if (at::GradMode::is_enabled()) {
    for (auto it = first; it != stack->end(); ++it) {
      if (it->isTensor() && it->toTensor().requires_grad()) {
        op.callBoxedForDispatchKey(c10::DispatchKey::Autograd, *stack);
        return;
      }
    }
  }
  c10::SmallVector<at::Tensor, 2> written;  // what the op writes in place (Tensor(a!) in the schema)
  for (size_t i = 0; i < arguments.size(); ++i) {
    const auto* alias = arguments[i].alias_info();
    if (alias != nullptr && alias->isWrite() && first[i].isTensor()) written.push_back(first[i].toTensor());
  }
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
  }
  // autograd notices a cache modified after being saved (what ADInplaceOrView does for ATen ops)
  for (auto& t : written) {
    if (!t.is_inference()) t.unsafeGetTensorImpl()->bump_version();
  }
}

void register_cpu_kernel(torch::Library& library, BoundOp op) {
  switch (op) {
    case kDecode: library.impl(kOpNames[op], TORCH_FN(decode_cpu)); break;
    case kKvProlog: library.impl(kOpNames[op], TORCH_FN(serve_kv_prolog<Caller::kDispatcher>)); break;
    case kLatentKvProlog: library.impl(kOpNames[op], TORCH_FN(serve_latent_kv_prolog<Caller::kDispatcher>)); break;
    case kGather: library.impl(kOpNames[op], TORCH_FN(gather_cpu)); break;
    case kGatherFunctional: library.impl(kOpNames[op], TORCH_FN(gather_functional_cpu)); break;
    case kScatter: library.impl(kOpNames[op], TORCH_FN(scatter_cpu)); break;
    case kScatterOnePool: library.impl(kOpNames[op], TORCH_FN(scatter_one_pool_cpu)); break;
    case kIndexer: library.impl(kOpNames[op], TORCH_FN(serve_lightning_indexer<Caller::kDispatcher>)); break;
    case kSparseAttention:
      library.impl(kOpNames[op], TORCH_FN(serve_sparse_mla_attention<Caller::kDispatcher>));
      break;
    case kNumOps: break;
  }
}

BoundOp bound_op(const std::string& name) {
  for (size_t i = 0; i < kNumOps; ++i)
    if (name == kOpNames[i]) return static_cast<BoundOp>(i);
  TORCH_CHECK(false, "mla-ops native kernels: no dispatcher kernel for mla.", name);
}

}  // namespace

std::vector<std::string> dispatcher_ops() { return {kOpNames.begin(), kOpNames.end()}; }

void bind(const std::vector<OpRequest>& requests) {
  unbind();
  auto cpu = std::make_unique<torch::Library>(torch::Library::IMPL, "mla", c10::DispatchKey::CPU, __FILE__, __LINE__);
  auto autograd =
      std::make_unique<torch::Library>(torch::Library::IMPL, "mla", c10::DispatchKey::AutogradCPU, __FILE__, __LINE__);
  for (const auto& request : requests) {
    const BoundOp op = bound_op(request.op);
    g_bindings[op] = {request.demand, request.refusal_head, request.refusal_tail};
    register_cpu_kernel(*cpu, op);
    autograd->impl(kOpNames[op], torch::CppFunction::makeFromBoxedFunction<&autograd_cpu>());
  }
  g_cpu_library = std::move(cpu);
  g_autograd_library = std::move(autograd);
}

void unbind() {
  g_autograd_library.reset();  // destroying a Library removes its registrations
  g_cpu_library.reset();
}

std::string registration_file() { return __FILE__; }

// ------------------------------------------------------------------------- the entry floor
// What a call from Python costs before any kernel work: a kernel that does nothing, registered for an
// op's schema in another namespace (`mla_ops.bench.native` defines the twins), consumes its arguments
// and returns its first tensor argument for each tensor it must return (aliasing outputs: a timing
// device, never an operator). Registered on CompositeImplicitAutograd, so the dispatcher reaches it in
// one hop from the Python entry: no kernel on the dispatcher can be called from Python for less.
namespace {
std::vector<std::unique_ptr<torch::Library>> g_floor_libraries;

void entry_floor_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t num_arguments = schema.arguments().size();
  std::optional<at::Tensor> first;
  for (auto it = stack->end() - static_cast<std::ptrdiff_t>(num_arguments); it != stack->end(); ++it) {
    if (it->isTensor()) {
      first = it->toTensor();
      break;
    }
  }
  torch::jit::drop(*stack, num_arguments);
  for (size_t i = 0; i < schema.returns().size(); ++i) {
    TORCH_CHECK(first.has_value(), schema.name(), ": an entry-floor twin needs a tensor argument to return");
    stack->emplace_back(*first);
  }
}
}  // namespace

void bind_entry_floor(const std::string& ns, const std::vector<std::string>& names) {
  auto library = std::make_unique<torch::Library>(torch::Library::IMPL, ns, c10::DispatchKey::CompositeImplicitAutograd,
                                                  __FILE__, __LINE__);
  for (const auto& name : names) {
    library->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunction<&entry_floor_kernel>());
  }
  g_floor_libraries.push_back(std::move(library));
}

// --------------------------------------------------------------- direct calls (no dispatcher)
// What `mla_ops.backends.cpu_native`'s Python kernels call: the same checks and kernels, with a call
// the kernel cannot serve refused rather than handed on (the caller chose this build explicitly).
at::Tensor call_decode_attention(const at::Tensor& q_latent, const at::Tensor& q_pe, const at::Tensor& key_cache,
                                 const at::Tensor& value_cache, const at::Tensor& block_tables,
                                 const at::Tensor& seq_lens, double softmax_scale, bool validate_values) {
  return serve_decode<Caller::kDirect>(q_latent, q_pe, key_cache, value_cache, block_tables, seq_lens, softmax_scale,
                                       validate_values);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> call_kv_prolog(
    const at::Tensor& hidden, const at::Tensor& kv_a_weight, const std::optional<at::Tensor>& kv_a_bias,
    const at::Tensor& kv_norm_weight, const at::Tensor& kv_b_weight, const at::Tensor& cos, const at::Tensor& sin,
    int64_t num_heads, int64_t qk_nope_head_dim, int64_t v_head_dim, double eps, const std::string& rope_layout,
    const std::string& rope_compute_dtype) {
  return serve_kv_prolog<Caller::kDirect>(hidden, kv_a_weight, kv_a_bias, kv_norm_weight, kv_b_weight, cos, sin,
                                          num_heads, qk_nope_head_dim, v_head_dim, eps, rope_layout,
                                          rope_compute_dtype);
}

std::tuple<at::Tensor, at::Tensor> call_latent_kv_prolog(const at::Tensor& hidden, const at::Tensor& kv_a_weight,
                                                         const std::optional<at::Tensor>& kv_a_bias,
                                                         const at::Tensor& kv_norm_weight, const at::Tensor& cos,
                                                         const at::Tensor& sin, double eps,
                                                         const std::string& rope_layout,
                                                         const std::string& rope_compute_dtype) {
  return serve_latent_kv_prolog<Caller::kDirect>(hidden, kv_a_weight, kv_a_bias, kv_norm_weight, cos, sin, eps,
                                                 rope_layout, rope_compute_dtype);
}

void call_gather_pa_kv_cache(const at::Tensor& key_cache, const at::Tensor& value_cache,
                             const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& key,
                             const at::Tensor& value, const std::optional<at::Tensor>& seq_offset,
                             bool is_seq_lens_cumsum) {
  gather_cpu(key_cache, value_cache, block_tables, seq_lens, key, value, seq_offset, is_seq_lens_cumsum);
}

std::tuple<at::Tensor, at::Tensor> call_gather_pa_kv_cache_functional(
    const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& block_tables,
    const at::Tensor& seq_lens, const at::Tensor& key, const at::Tensor& value,
    const std::optional<at::Tensor>& seq_offset, bool is_seq_lens_cumsum) {
  return gather_functional_cpu(key_cache, value_cache, block_tables, seq_lens, key, value, seq_offset,
                               is_seq_lens_cumsum);
}

void call_scatter_pa_kv_cache(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                              const at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  scatter_cpu(key, value, key_cache, value_cache, slot_mapping);
}

void call_scatter_pa_cache(const at::Tensor& key, const at::Tensor& cache, const at::Tensor& slot_mapping) {
  scatter_one_pool_cpu(key, cache, slot_mapping);
}

at::Tensor call_lightning_indexer(const at::Tensor& q, const at::Tensor& weights, const at::Tensor& k_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                  const at::Tensor& query_start_loc, int64_t topk, double softmax_scale) {
  return serve_lightning_indexer<Caller::kDirect>(q, weights, k_cache, block_tables, seq_lens, query_start_loc, topk,
                                                  softmax_scale);
}

at::Tensor call_sparse_mla_attention(const at::Tensor& q_latent, const at::Tensor& q_pe, const at::Tensor& key_cache,
                                     const at::Tensor& value_cache, const at::Tensor& block_tables,
                                     const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                                     const at::Tensor& topk_indices, double softmax_scale) {
  return serve_sparse_mla_attention<Caller::kDirect>(q_latent, q_pe, key_cache, value_cache, block_tables, seq_lens,
                                                     query_start_loc, topk_indices, softmax_scale);
}

}  // namespace CPU_CAPABILITY
}  // namespace mla_native
