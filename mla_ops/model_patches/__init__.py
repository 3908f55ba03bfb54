"""Patches that route HuggingFace transformers models through `torch.ops.mla` (ARCHITECTURE §5).

transformers is imported only when a patch is applied."""
