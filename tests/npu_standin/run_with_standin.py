"""Driver for tests that run mla-ops' NPU path on the torch_npu stand-in (in a subprocess).

The PyPTO stage-2 launch needs an NPU, so it is replaced by `stage2_on_cpu`, which computes the
same outputs with the baseline composite and records the call (the PyPTO gather likewise, with the
reference kernel): the control flow that chooses and
calls the kernel is mla-ops' own, only the launch is stood in for.
"""
import sys

import torch

from mla_ops.backends import npu

STAGE2_CALLS = []


def stage2_on_cpu(latent, k_pe, kv_b_weight, cos, sin, *, num_heads, qk_nope_head_dim, v_head_dim, rope_layout,
                  mode):
    STAGE2_CALLS.append((latent.shape[0], latent.dtype, rope_layout, mode, latent.device.type))
    # the real kernel's entry check first: a call it cannot take raises ValueError there, as on a device
    from mla_ops.kernels.pypto.kv_prolog_stage2 import kv_prolog_stage2_not_supported_reasons

    reasons = kv_prolog_stage2_not_supported_reasons(latent, k_pe, kv_b_weight, cos, sin, num_heads=num_heads,
                                                     qk_nope_head_dim=qk_nope_head_dim, v_head_dim=v_head_dim,
                                                     rope_layout=rope_layout, mode=mode)
    if reasons:
        raise ValueError("kv_prolog_stage2: " + "; ".join(reasons))
    return npu.baseline_stage2(latent, k_pe, kv_b_weight, cos, sin, num_heads=num_heads,
                                qk_nope_head_dim=qk_nope_head_dim, v_head_dim=v_head_dim, rope_layout=rope_layout)


def gather_on_cpu(key_cache, value_cache, block_tables, seq_lens, key, value, *, seq_offset=None,
                  is_seq_lens_cumsum=False, mode):
    STAGE2_CALLS.append(("gather", mode, key.device.type))
    from mla_ops.ops.gather_pa_kv_cache import gather_pa_kv_cache_reference

    gather_pa_kv_cache_reference(key_cache, value_cache, block_tables, seq_lens, key, value, seq_offset=seq_offset,
                                 is_seq_lens_cumsum=is_seq_lens_cumsum)


npu.kv_prolog_stage2 = stage2_on_cpu
npu.pypto_gather = gather_on_cpu

if __name__ == "__main__":
    from mla_ops.cli import main

    code = main(sys.argv[1:])
    print("STAGE2_CALLS", STAGE2_CALLS)
    torch.npu.synchronize()
    sys.exit(code)
