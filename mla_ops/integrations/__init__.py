"""Integrations of the `mla` ops into model libraries and serving engines.

They use the public ops (`torch.ops.mla.*`) only, never a backend's kernels directly, so whatever
backend serves an op serves it inside the integration too.
"""
