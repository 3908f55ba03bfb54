"""The package version, written here only: setup.py reads this file as text, `mla_ops.__version__` imports it."""
__version__ = "0.1.0"
