"""Probes for heavy optional packages, without importing them.

`import mla_ops` must work on a machine that has none of torch_npu, torchair, pypto or matplotlib,
and must not initialise any device. Everything here answers "could it be imported?" with
`importlib.util.find_spec`: nothing is imported.
"""
from __future__ import annotations

import functools
import importlib.util


@functools.lru_cache(maxsize=None)
def has_module(name: str) -> bool:
    """True when `name` is installed (found by the import system); nothing is imported."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package that fails to import, or a bad name
        return False
