// Python module of one ISA build of the native CPU kernels: _C_avx512 / _C_avx2 / _C_default
// (TORCH_EXTENSION_NAME). Calls reach the kernels two ways:
// * through the dispatcher, once the backend layer has bound them (`bind`, registration.cpp):
//   `torch.ops.mla.<op>` on CPU tensors runs C++ only;
// * directly, with the op's own argument names and defaults (tests and benchmarks that pick a build,
//   and the backend layer's Python kernels): the same checks and kernels, a call the kernel cannot
//   serve refused with NotImplementedError naming the reasons.
//
// `<op>_reasons(...)`: why the kernel cannot serve a call (a list of sentences; empty: it can), for
// `mla_ops.explain`. They assume the op's metadata check passed. The GIL is released around every
// kernel: they only touch tensors (and may run for ms).
#include <torch/csrc/utils/pybind.h>  // pybind11 + the at::Tensor caster (lighter than torch/extension.h)

#include "ops.h"
#include "registration.h"

#define MLA_STR2(x) #x
#define MLA_STR(x) MLA_STR2(x)

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  using namespace mla_native;
  using py::arg;
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  m.doc() = "mla-ops native CPU kernels (" MLA_STR(CPU_CAPABILITY) " build)";
  m.def("isa", [] { return std::string(MLA_STR(CPU_CAPABILITY)); });

  py::class_<OpRequest>(m, "OpRequest")
      .def(py::init<std::string, bool, std::string, std::string>(), arg("op"), arg("demand"), arg("refusal_head"),
           arg("refusal_tail"))
      .def_readonly("op", &OpRequest::op)
      .def_readonly("demand", &OpRequest::demand);
  m.def("dispatcher_ops", &dispatcher_ops);
  m.def("bind", &bind, arg("requests"));
  m.def("unbind", &unbind);
  m.def("registration_file", &registration_file);
  m.def("bind_entry_floor", &bind_entry_floor, arg("namespace"), arg("names"));

  m.def("mla_decode_attention", &call_decode_attention, arg("q_latent"), arg("q_pe"), arg("key_cache"),
        arg("value_cache"), arg("block_tables"), arg("seq_lens"), arg("softmax_scale"), py::kw_only(),
        arg("validate_values") = true, no_gil);
  m.def("kv_prolog", &call_kv_prolog, arg("hidden_states"), arg("kv_a_weight"), arg("kv_a_bias"),
        arg("kv_norm_weight"), arg("kv_b_weight"), arg("cos"), arg("sin"), py::kw_only(), arg("num_heads"),
        arg("qk_nope_head_dim"), arg("v_head_dim"), arg("eps") = 1e-6, arg("rope_layout") = "interleaved",
        arg("rope_compute_dtype") = "float32", no_gil);
  m.def("latent_kv_prolog", &call_latent_kv_prolog, arg("hidden_states"), arg("kv_a_weight"), arg("kv_a_bias"),
        arg("kv_norm_weight"), arg("cos"), arg("sin"), py::kw_only(), arg("eps") = 1e-6,
        arg("rope_layout") = "interleaved", arg("rope_compute_dtype") = "float32", no_gil);
  m.def("gather_pa_kv_cache", &call_gather_pa_kv_cache, arg("key_cache"), arg("value_cache"), arg("block_tables"),
        arg("seq_lens"), arg("key"), arg("value"), py::kw_only(), arg("seq_offset") = py::none(),
        arg("is_seq_lens_cumsum") = false, no_gil);
  m.def("gather_pa_kv_cache_functional", &call_gather_pa_kv_cache_functional, arg("key_cache"), arg("value_cache"),
        arg("block_tables"), arg("seq_lens"), arg("key"), arg("value"), py::kw_only(), arg("seq_offset") = py::none(),
        arg("is_seq_lens_cumsum") = false, no_gil);
  m.def("scatter_pa_kv_cache", &call_scatter_pa_kv_cache, arg("key"), arg("value"), arg("key_cache"),
        arg("value_cache"), arg("slot_mapping"), no_gil);
  m.def("scatter_pa_cache", &call_scatter_pa_cache, arg("key"), arg("cache"), arg("slot_mapping"), no_gil);
  m.def("lightning_indexer", &call_lightning_indexer, arg("q"), arg("weights"), arg("k_cache"), arg("block_tables"),
        arg("seq_lens"), arg("query_start_loc"), arg("topk"), arg("softmax_scale"), no_gil);
  m.def("sparse_mla_attention", &call_sparse_mla_attention, arg("q_latent"), arg("q_pe"), arg("key_cache"),
        arg("value_cache"), arg("block_tables"), arg("seq_lens"), arg("query_start_loc"), arg("topk_indices"),
        arg("softmax_scale"), no_gil);

  m.def("attention_engine", &attention_engine, arg("q_latent"), arg("key_cache"), arg("value_cache"));
  m.def(
      "mla_decode_attention_reasons",
      [](const at::Tensor& q_latent, const at::Tensor& key_cache, const at::Tensor& value_cache) {
        return decode_reasons(q_latent, key_cache, value_cache);
      },
      arg("q_latent"), arg("key_cache"), arg("value_cache"));
  m.def(
      "sparse_mla_attention_reasons",
      [](const at::Tensor& q_latent, const at::Tensor& key_cache, const at::Tensor& value_cache) {
        return sparse_attention_reasons(q_latent, key_cache, value_cache);
      },
      arg("q_latent"), arg("key_cache"), arg("value_cache"));
  m.def(
      "lightning_indexer_reasons", [](const at::Tensor& q) { return indexer_reasons(q); }, arg("q"));
  // kv_prolog and latent_kv_prolog: cos and sin are the last two positional arguments
  m.def(
      "prolog_reasons",
      [](const at::Tensor& hidden_states, const at::Tensor& cos, const at::Tensor& sin, const std::string& rope_layout,
         const std::string& rope_compute_dtype) {
        return prolog_reasons(hidden_states, cos, sin, rope_layout, rope_compute_dtype);
      },
      arg("hidden_states"), arg("cos"), arg("sin"), arg("rope_layout") = "interleaved",
      arg("rope_compute_dtype") = "float32");
}
