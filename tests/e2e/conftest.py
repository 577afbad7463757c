"""The e2e tier's shared fixture: a real Prefect server on loopback."""

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.prefect import Server, prefect_server_at


@pytest.fixture
def prefect_server(tmp_path: Path) -> Iterator[Server]:
    with prefect_server_at(tmp_path) as server:
        yield server
