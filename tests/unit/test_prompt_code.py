"""`tasks.prompt_code`: function contracts composed anew, whose example holds for their reference body, whose
names seldom recur, and which half the `completion` prompts carry."""

import random
from collections import Counter

import pytest

from draftsmith.tasks import prompt_code, prompt_pool_reuse

pytestmark = pytest.mark.unit


def _function(spec: prompt_code.FunctionSpec):
    """The reference body run as the function it belongs to."""
    signature = ", ".join(f"{p}: {t}" for p, t in spec.params)
    scope: dict = {}
    exec(f"def {spec.names[0]}({signature}) -> {spec.returns}:\n{spec.body}", scope)
    return scope[spec.names[0]]


def test_every_composed_example_holds_for_its_reference_body():
    rng = random.Random(0)
    kinds: Counter[str] = Counter()
    for _ in range(400):
        spec = prompt_code.composed(rng)
        fn = _function(spec)
        for _ in range(3):
            args, result = spec.example(rng)
            assert fn(*args) == result, (spec.doc, spec.body, args)
        assert spec.doc.startswith("Take the items of {0}") and spec.doc.endswith(".")
        assert spec.params[0][0] in spec.body and "{" not in spec.body
        kinds["loop" if "for " in spec.body.split("\n")[1] else "comprehension"] += 1
        kinds[spec.returns] += 1
    # Both body forms and both kinds of result occur.
    assert min(kinds.values()) > 60, kinds


def test_composed_contracts_seldom_recur_and_the_same_seed_draws_the_same():
    rng = random.Random(1)
    specs = [prompt_code.composed(rng) for _ in range(300)]
    assert len({(s.names, s.doc) for s in specs}) >= 280
    assert len({s.params[0][0] for s in specs}) > 120
    again = prompt_code.composed(random.Random(7))
    assert (again.names, again.doc, again.body) == (lambda s: (s.names, s.doc, s.body))(
        prompt_code.composed(random.Random(7))
    )


def test_half_the_completion_prompts_carry_a_composed_contract():
    rng = random.Random(2)
    texts = [prompt_pool_reuse.GENERATORS["completion"](rng)[0] for _ in range(400)]
    share = sum("Take the items of" in t for t in texts) / len(texts)
    assert abs(share - prompt_pool_reuse.COMPOSED_SHARE) < 0.08, share
