"""What the tests (and the benchmarks that re-run their scenarios) share, one module per kind of helper:

- `paths`: where the checkout's recipes are;
- `models`: tiny targets and drafters of every family;
- `runs`: run-folder contents (store samples, plot checks);
- `kernels`: kernel parity tolerances and inputs; `stats`: distribution checks;
- `openai_server`: the fake OpenAI-compatible chat server; `s3`: a real S3 server (SeaweedFS);
  `prefect`: a real Prefect server and the CLI run against it;
- `faults`: the fault scenarios `tests/faults` asserts on and `benchmarks/faults.py` repeats;
- `fuzz`: hypothesis settings; `toy_family`: a drafter family defined only here, loaded as a plugin.

Test modules import helpers from here, never from one another (`tests/unit/test_test_layout.py`).
"""
