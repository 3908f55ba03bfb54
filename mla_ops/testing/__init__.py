"""Test and verification support shared by the test suite, `mla-ops selftest` and the benchmarks."""
