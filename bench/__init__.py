"""Benchmarks: each writes a markdown table, a PNG and JSON under docs/benchmarks/."""
