"""Benchmarks behind `mla-ops bench` (numbers live here and in benchmarks/, never in tests)."""
