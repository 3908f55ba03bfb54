// The native kernels on the dispatcher: one line per op (native_op.h says what the registration does).
#include "arguments.h"
#include "kernels/kernels.h"
#include "native_op.h"
#include "reasons.h"

namespace mla_native {

TORCH_LIBRARY_IMPL(mla, CatchAll, m) {
  // the kernel (kernels/kernels.h), its op's metadata check (arguments.h), the backend's reasons (reasons.h:
  // the function and the positions of the op arguments it reads)
  register_native_op<mla_decode_attention_kernel, check_decode_attention_args, ReasonsOf<decode_reasons, 0, 2, 3>>(m);
  register_native_op<kv_prolog_kernel, check_kv_prolog_args, ReasonsOf<prolog_reasons, 0, 5, 6, 11, 12>>(m);
  register_native_op<latent_kv_prolog_kernel, check_latent_kv_prolog_args, ReasonsOf<prolog_reasons, 0, 4, 5, 7, 8>>(m);
  register_native_op<rms_norm_kernel, check_rms_norm_args, ReasonsOf<rms_norm_reasons, 0, 1>>(m);
  register_native_op<gather_pa_kv_cache_kernel, check_gather_pa_kv_cache_args, ServesEveryCall>(m);
  register_native_op<gather_pa_kv_cache_functional_kernel, check_gather_pa_kv_cache_functional_args,
                     ServesEveryCall>(m);
  register_native_op<scatter_pa_kv_cache_kernel, check_scatter_pa_kv_cache_args, ServesEveryCall>(m);
  register_native_op<scatter_pa_cache_kernel, check_scatter_pa_cache_args, ServesEveryCall>(m);
  register_native_op<lightning_indexer_kernel, check_lightning_indexer_args, ReasonsOf<dtype_reasons, 0>>(m);
  register_native_op<sparse_mla_attention_kernel, check_sparse_mla_attention_args,
                     ReasonsOf<sparse_attention_reasons, 0, 2, 3>>(m);
  register_native_op<mla_prefill_attention_kernel, check_mla_prefill_attention_args,
                     ReasonsOf<prefill_attention_reasons, 0, 2, 3>>(m);
  register_native_op<mha_prefill_attention_kernel, check_mha_prefill_attention_args,
                     ReasonsOf<mha_prefill_reasons, 0>>(m);
  register_native_op<shared_kv_q_prolog_kernel, check_shared_kv_q_prolog_args, ReasonsOf<dtype_reasons, 0>>(m);
  register_native_op<shared_kv_prolog_kernel, check_shared_kv_prolog_args, ReasonsOf<dtype_reasons, 0>>(m);
  register_native_op<kv_compressor_kernel, check_kv_compressor_args, ReasonsOf<dtype_reasons, 0>>(m);
  register_native_op<shared_kv_attention_kernel, check_shared_kv_attention_args,
                     ReasonsOf<shared_kv_attention_reasons, 0, 1, 8>>(m);
}

}  // namespace mla_native
