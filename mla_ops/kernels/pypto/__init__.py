"""PyPTO kernels of mla_ops (pypto==0.2.0): the KV prolog's stage 2 and the paged-cache copies.

* `kv_prolog_stage2` — kv_b projection, k_nope/value split and RoPE over T tokens, one kernel.
* `gather_pa_kv_cache` — the GatherPaKvCache "Norm"/ND branch (two tile configurations).
* `scatter_pa_kv_cache` — token rows into their cache slots.

Each module builds its kernel for `mode="sim"` (CPU tensors, through `mla_ops.pypto_runtime`'s
simulator with pass verification) or `mode="npu"` (torch_npu tensors, launched on the current
stream). Importing these modules does not import pypto; building a kernel does.
"""
