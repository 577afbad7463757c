"""Fault scenarios that `tests/faults` asserts on and `benchmarks/faults.py` repeats: each a plain function
returning a `FaultResult` (`result.py`). `servers`: a flaky OpenAI-compatible endpoint, a poisoned DCP
checkpoint; `storage`: an S3 server restarted mid-write, a read-only bucket, a full disk; `stream`: a killed
Mooncake master, a lost or stopped rank, a killed stream holder. Each module lists its own in `SCENARIOS`.
"""
