"""The regenerate stage against an OpenAI-compatible server that fails at random (fixed seed): 5xx
answers, requests hanging past the client's timeout, connections dropped halfway through a response.
Every training prompt ends up answered exactly once in the committed shards, with the answer the server
gives when nothing goes wrong."""

import pytest

from tests.support.faults.servers import flaky_endpoint

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_every_prompt_is_answered_once_through_a_flaky_endpoint(tmp_path):
    r = flaky_endpoint(tmp_path, seed=1)
    assert r.units > 0 and r.detail["rows"] == r.units
    assert (r.lost, r.duplicated, r.corrupted) == (0, 0, 0), r
    # The seed injects every kind of fault, so each retry path was taken.
    assert set(r.detail["faults"]) == {"5xx", "hang", "drop"}, r.detail
