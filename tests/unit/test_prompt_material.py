"""`tasks.prompt_material`: reuse material that does not recur, so a drafter can only copy it, drawn
reproducibly, and carried by the reuse kinds' prompts."""

import random
from collections import Counter

import pytest

from draftsmith.tasks import prompt_material as material
from draftsmith.tasks import prompt_pool_reuse

pytestmark = pytest.mark.unit


def test_the_same_seed_draws_the_same_passage():
    assert material.passage(random.Random(5)) == material.passage(random.Random(5))
    assert material.passage(random.Random(5)) != material.passage(random.Random(6))


def test_sentences_people_and_codes_almost_never_recur():
    rng = random.Random(0)
    sentences = [material.sentence(rng) for _ in range(2000)]
    assert len(set(sentences)) >= 1990
    people = Counter(material.person(rng) for _ in range(2000))
    assert len(people) > 1000 and people.most_common(1)[0][1] <= 6
    assert len({material.town(rng) for _ in range(2000)}) > 250
    assert len({material.code(rng) for _ in range(2000)}) >= 1990
    # Every sentence carries a figure to copy, and a passage holds as many sentences as asked.
    assert all(any(ch.isdigit() for ch in s) for s in sentences)
    assert material.passage(rng, 3, 3).count(". ") == 2


@pytest.mark.parametrize("kind", ["editing", "extraction", "followup"])
def test_the_reuse_kinds_carry_material_that_does_not_repeat(kind):
    """Over 300 prompts of a kind, no sentence of its material recurs more than a few times; with fixed
    passages (the old editing generator) each sentence recurred dozens of times."""
    gen = prompt_pool_reuse.GENERATORS[kind]
    rng = random.Random(1)
    counts: Counter[str] = Counter()
    for _ in range(300):
        text = "\n".join(gen(rng))
        counts.update(s.strip() for s in text.replace("\n", " ").split(". ") if len(s.split()) >= 6)
    fresh = sum(n for s, n in counts.items() if n == 1)
    assert fresh / sum(counts.values()) > 0.4, counts.most_common(5)
