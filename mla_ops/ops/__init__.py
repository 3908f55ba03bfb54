"""Op implementations: `reference/` (torch), `pypto/` (PyPTO kernels + CPU simulation), `npu/`
(Ascend dispatch). The modules directly in this package are the typed public wrappers, one per op
family, re-exported by `mla_ops`."""
