// Python bindings of the native CPU kernels: plain functions (no dispatcher registration); the
// Python layer (mla_ops/native_cpu.py) runs the metadata checks and binds them to torch.ops.mla.
//
// Module name: _C_avx512 / _C_avx2 / _C_default (TORCH_EXTENSION_NAME, one build per ISA).
// Inputs are assumed metadata-valid (ranks, sizes, dtypes float32/float16/bfloat16, CPU device);
// index VALUES are checked here.
//
//   decode_attention(q_latent [B,N,L], q_pe [B,N,R], key_cache [NB,bs,1,L], value_cache [NB,bs,1,R],
//                    block_tables [B,maxb] int32|int64, seq_lens [B] int32|int64, softmax_scale: float,
//                    validate: bool = True) -> Tensor [B,N,L] | None
//       None (only with validate=True): a length outside [1, maxb*bs] or a used block id outside
//       [0, NB); nothing computed. validate=False: lengths clamped to [0, maxb*bs], 0 -> zero row,
//       out-of-range block ids skipped.
//   kv_prolog(hidden [B,S,H], kv_a_weight [L+R,H], kv_a_bias [L+R] | None, kv_norm_weight [L],
//             kv_b_weight [N*(P+V),L], cos, sin [B|1,S,R/2] | [S,R/2], num_heads: int,
//             qk_nope_head_dim: int, v_head_dim: int, eps: float, interleaved: bool)
//       -> (k_nope [B,N,S,P], value [B,N,S,V], k_pe [B,1,S,R])
//   latent_kv_prolog(hidden, kv_a_weight, kv_a_bias | None, kv_norm_weight, cos, sin, eps: float,
//                    interleaved: bool) -> (latent [B,S,L], k_pe [B,S,R])
//   gather_pa_kv_cache(key_cache [NB,bs,Hk,Dk], value_cache [NB,bs,Hv,Dv], block_tables [Q,cols],
//                      seq_lens [Q] | [Q+1] (cumsum), key [T,Hk,Dk] (out), value [T,Hv,Dv] (out),
//                      seq_offset [Q] | None, is_seq_lens_cumsum: bool) -> int (0 ok, 1 bad value)
//   scatter_pa_kv_cache(key [T,Hk,Dk], value [T,Hv,Dv], key_cache (out), value_cache (out),
//                       slot_mapping [T]) -> int (0 ok, 1 bad value; negative slots are padding)
//   isa() -> str: the CPU_CAPABILITY this module was compiled for.
#include <torch/csrc/utils/pybind.h>  // pybind11 + the at::Tensor caster (lighter than torch/extension.h)

#include "ops.h"

#define MLA_STR2(x) #x
#define MLA_STR(x) MLA_STR2(x)

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  using namespace mla_native;
  m.doc() = "mla-ops native CPU kernels (" MLA_STR(CPU_CAPABILITY) " build)";
  m.def("isa", [] { return std::string(MLA_STR(CPU_CAPABILITY)); });
  // The GIL is released around every kernel: they only touch tensors (and may run for ms).
  m.def("decode_attention", &decode_attention, py::arg("q_latent"), py::arg("q_pe"), py::arg("key_cache"),
        py::arg("value_cache"), py::arg("block_tables"), py::arg("seq_lens"), py::arg("softmax_scale"),
        py::arg("validate") = true, py::call_guard<py::gil_scoped_release>());
  m.def("kv_prolog", &kv_prolog, py::arg("hidden"), py::arg("kv_a_weight"), py::arg("kv_a_bias"),
        py::arg("kv_norm_weight"), py::arg("kv_b_weight"), py::arg("cos"), py::arg("sin"), py::arg("num_heads"),
        py::arg("qk_nope_head_dim"), py::arg("v_head_dim"), py::arg("eps"), py::arg("interleaved"),
        py::call_guard<py::gil_scoped_release>());
  m.def("latent_kv_prolog", &latent_kv_prolog, py::arg("hidden"), py::arg("kv_a_weight"), py::arg("kv_a_bias"),
        py::arg("kv_norm_weight"), py::arg("cos"), py::arg("sin"), py::arg("eps"), py::arg("interleaved"),
        py::call_guard<py::gil_scoped_release>());
  m.def("gather_pa_kv_cache", &gather_pa_kv_cache, py::arg("key_cache"), py::arg("value_cache"),
        py::arg("block_tables"), py::arg("seq_lens"), py::arg("key"), py::arg("value"), py::arg("seq_offset"),
        py::arg("is_seq_lens_cumsum"), py::call_guard<py::gil_scoped_release>());
  m.def("scatter_pa_kv_cache", &scatter_pa_kv_cache, py::arg("key"), py::arg("value"), py::arg("key_cache"),
        py::arg("value_cache"), py::arg("slot_mapping"), py::call_guard<py::gil_scoped_release>());
}
