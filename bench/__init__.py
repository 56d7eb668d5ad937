"""Benchmarks for inferq: an OpenAI-compatible serving load generator (``bench.serve_bench``)."""
