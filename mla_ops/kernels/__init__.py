"""Kernel bodies for other compilers than torch's (today: PyPTO, for Ascend NPUs).

The backends in `mla_ops.backends` decide when these run; nothing here registers an operator."""
