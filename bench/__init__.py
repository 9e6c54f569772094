"""Benchmark suites (a package so test module names do not clash with tests/)."""
