"""Evaluation: benchmark suites and loaders, serving throughput sweeps, reports and plots.

Speculative decoding itself (verification rules, the per-family decoders) lives in `drafters/`.
"""
