"""The fuzz tests' shared Hypothesis settings: derandomized, so a run is the same everywhere."""

from hypothesis import HealthCheck, settings

FUZZ = settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
