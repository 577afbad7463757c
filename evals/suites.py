"""Built-in benchmark suites: one per synthetic prompt category, the embedded default (no files, no network).

Why not draw them from `draftsmith.tasks.prompt_pool`: the select stage trains on that pool, and a suite drawn from
the same templates with another seed can repeat a training prompt word for word (short templates such as
"How do you say X in Y?" have only a few hundred texts). So the suites use their own templates, and every
template carries at least one slot from an eval-only vocabulary (`EVAL_ONLY_TERMS`), words that occur
nowhere in `tasks/prompt_pool.py`. A synthetic training prompt is assembled only from that module's strings
and digits, so no training pool, at any seed or size, can contain a built-in item (the unit tests check
both the vocabulary and the smollm2 recipe's actual training prompts).

Items are drawn from a private RNG per category seeded with a string ("draftsmith-evals:{seed}:{category}"),
a separate seed space from the select stage's integer seeds; a suite of n items is a prefix of the suite of
n + k items. Dialogue items have exactly two user turns, so multi-turn regeneration is exercised.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from draftsmith.core.config.select import SYNTHETIC_CATEGORIES as CATEGORIES
from draftsmith.core.prompt_keys import dedupe_key
from draftsmith.evals import suites_reuse
from draftsmith.evals.records import BenchPrompt

SOURCE = "builtin"
# Redraws per item before giving up; every category's template space holds tens of thousands of texts.
_MAX_ATTEMPTS = 50

# --------------------------------------------------------------------------------------------------
# Eval-only vocabulary: none of these strings may occur in tasks/prompt_pool.py (a unit test checks).

_NAMES = (
    "Oksana|Tobias|Yusuf|Ingrid|Oluwaseun|Marisol|Torvald|Annelise|Rafael|Dmitri|Leilani|Bartholomew|Svetlana|Ezekiel|"
    "Ximena|Gunnar|Ngozi|Thiago"
).split("|")
_GOODS = "thimbles|kazoos|seed packets|lanyards|paintbrushes|jars of honey|bus tickets|kites|flowerpots".split("|")
_CODE_TASKS = (
    "merges overlapping intervals in a list of (start, end) pairs|rotates a square matrix by 90 degrees "
    "clockwise|checks whether a string is a valid IPv4 address|returns the longest substring without "
    "repeating characters|computes the edit distance between two strings|finds the first non-repeating "
    "character in a string|converts an integer to its Roman numeral|checks whether a Sudoku row, column "
    "and box layout is valid|returns the intersection of two arrays without duplicates|evaluates a "
    "postfix arithmetic expression|parses a query string into a dictionary|finds the peak element of a "
    "mountain-shaped array|generates every subset of a small set|checks whether a linked list has a cycle"
).split("|")
_RIDDLE_OBJECTS = "lanterns|teapots|sandcastles|snow globes|origami cranes|wooden spoons".split("|")
_PHENOMENA = (
    "a spoon looks bent in a glass of water|dew forms on grass overnight|a seashell seems to hold the "
    "sound of the sea|popcorn pops when heated|a boomerang comes back|soap bubbles show swirling "
    "colors|cats land on their feet|a fridge magnet sticks to the door|old books smell sweet"
).split("|")
_STORY_SUBJECTS = (
    "a clockmaker's apprentice|a library that opens only at midnight|the first snowfall in a desert "
    "town|a retired astronaut growing tomatoes|a glove trying to find its owner|a bridge that hums in "
    "the wind|a lighthouse cat|two rival ice-cream vans|a map that redraws itself|a violin nobody can tune"
).split("|")
_SENTENCES = (
    "The museum closes early on public holidays.|My grandmother grows lemons on her balcony.|The night "
    "bus was quieter than usual.|We missed the ferry by two minutes.|The bakery on the corner sells out "
    "by nine.|Fresh snow covered the mountain pass.|Our neighbours adopted a three-legged dog."
).split("|")
_SITUATIONS = (
    "I am adopting a retired greyhound|I have to give a toast at my sister's wedding|My sourdough "
    "starter smells like nail polish|I want to turn my balcony into a herb garden|I am moving to a flat "
    "without an oven|My team keeps missing our standup meetings"
).split("|")
_FOLLOW_UPS = (
    "Which part of that is easiest to get wrong?|Rewrite your answer as three numbered steps.|Could you "
    "double-check that answer?|Now explain it to someone who is in a hurry.|What would you change if "
    "the budget were halved?|Turn that into a checklist I can print."
).split("|")

EVAL_ONLY_TERMS: tuple[str, ...] = tuple(
    dict.fromkeys(
        [
            *_NAMES,
            *_GOODS,
            *_CODE_TASKS,
            *_RIDDLE_OBJECTS,
            *_PHENOMENA,
            *_STORY_SUBJECTS,
            *_SENTENCES,
            *_SITUATIONS,
            *suites_reuse.REUSE_ONLY_TERMS,
        ]
    )  # fmt: skip
)

# Not eval-only (languages and forms also occur in training prompts); the slots above make items unique.
_LANGS = ("Python", "Python", "JavaScript", "Go", "Rust", "Java")
_HUMAN_LANGS = ("French", "Spanish", "German", "Italian", "Portuguese", "Dutch", "Japanese")
_FORMS = ("short story", "poem", "haiku", "diary entry", "fable", "news report", "limerick")
_TONES = ("wistful", "cheerful", "deadpan", "suspenseful", "gentle")


# --------------------------------------------------------------------------------------------------
# Generators: each returns the user turns of one item.


def _math(rng: random.Random) -> list[str]:
    name, other = rng.sample(_NAMES, 2)
    goods = rng.choice(_GOODS)
    a, b, k = rng.randint(3, 15), rng.randint(2, 9), rng.randint(2, 6)
    save, weeks = rng.randint(5, 40), rng.randint(3, 12)
    options = (
        f"{name} saves ${save} every week for {weeks} weeks, then buys {k} {goods} at ${b} each. "
        f"How much money is left?",
        f"{name} reads {a} pages a day of a book with {a * weeks + b} pages. On which day does {name} finish?",
        f"{name} shares {k * a + b} {goods} equally among {k} friends and keeps the rest. "
        f"How many does each friend get, and how many are kept?",
        f"{name} walks {a} km on Monday, {b} km on Tuesday and twice Tuesday's distance on Wednesday. "
        f"What is the total distance?",
        f"{name} buys {goods} for ${save * k} and sells them for ${save * k + a * k}. "
        f"What is the profit as a percentage of the cost?",
        f"{name} is {a + 20} and {other} is {b + 5}. In how many years will {name} be twice as old as {other}, "
        f"if ever?",
    )
    return [rng.choice(options) + rng.choice(("", " Show each step.", " Give just the number."))]


def _coding(rng: random.Random) -> list[str]:
    lang, task = rng.choice(_LANGS), rng.choice(_CODE_TASKS)
    options = (
        f"Implement a {lang} function that {task}.",
        f"Write a {lang} function that {task}, and state its time complexity.",
        f"Write a {lang} function that {task}. Include two example calls.",
        f"Sketch a {lang} function that {task}, then list the edge cases it handles.",
        f"Explain how you would test a {lang} function that {task}.",
    )
    return [rng.choice(options)]


def _reasoning(rng: random.Random) -> list[str]:
    a, b, c = rng.sample(_NAMES, 3)
    thing = rng.choice(_RIDDLE_OBJECTS)
    n, m = rng.randint(3, 9), rng.randint(10, 40)
    red, blue = rng.randint(2, 9), rng.randint(2, 9)
    options = (
        f"{a} finished the race before {b}, and {c} finished after {b}. Who came first, and who came last?",
        f"If {n} workers make {n} {thing} in {n} minutes, how long do {m} workers need for {m} {thing}?",
        f"Why is it that {rng.choice(_PHENOMENA)}? Explain briefly.",
        f"{a} says {b} is lying. {b} says {c} is lying. {c} says both {a} and {b} are lying. Who tells the truth?",
        f"A box holds {red} red and {blue} blue {thing}. {a} takes two without looking. "
        f"What is the chance both are red?",
    )
    return [rng.choice(options)]


def _writing(rng: random.Random) -> list[str]:
    subject, form, tone = rng.choice(_STORY_SUBJECTS), rng.choice(_FORMS), rng.choice(_TONES)
    options = (
        f"Write a {tone} {form} about {subject}.",
        f"Write the opening paragraph of a {form} about {subject}.",
        f"Describe {subject} in five vivid sentences.",
        f"Write a {tone} letter from {rng.choice(_NAMES)} to a friend about {subject}.",
        f"Suggest three titles for a {form} about {subject}.",
    )
    return [rng.choice(options)]


def _multilingual(rng: random.Random) -> list[str]:
    lang, sentence = rng.choice(_HUMAN_LANGS), rng.choice(_SENTENCES)
    options = (
        f'Translate into {lang}: "{sentence}"',
        f'Translate "{sentence}" into {lang} and explain one word choice.',
        f"Answer in {lang}: {_math(rng)[0]}",
        f"Write two sentences in {lang} about {rng.choice(_STORY_SUBJECTS)}.",
        f"Answer in {lang}: {_reasoning(rng)[0]}",
    )
    return [rng.choice(options)]


def _dialogue(rng: random.Random) -> list[str]:
    opener = rng.choice(
        (
            _math(rng)[0],
            _coding(rng)[0],
            _reasoning(rng)[0],
            _writing(rng)[0],
            f"{rng.choice(_SITUATIONS)}. What should I do first?",
        )
    )
    # Exactly two turns: the follow-up only makes sense with the first answer in context.
    return [opener, rng.choice(_FOLLOW_UPS)]


_GENERATORS: dict[str, Callable[[random.Random], list[str]]] = {
    "math": _math,
    "coding": _coding,
    "reasoning": _reasoning,
    "writing": _writing,
    "multilingual": _multilingual,
    "dialogue": _dialogue,
    **suites_reuse.GENERATORS,
}
assert tuple(_GENERATORS) == CATEGORIES, "one built-in suite per synthetic prompt category"


def builtin_suites(n_per_suite: int, seed: int) -> dict[str, list[BenchPrompt]]:
    """The built-in suites, one per category of `draftsmith.tasks.prompt_pool.CATEGORIES`, in that order.

    Args:
        n_per_suite: Items per suite (>= 0); items within a suite have distinct texts.
        seed: Suite seed; equal arguments give equal suites, and a longer suite extends a shorter one.

    Returns:
        `{category: [BenchPrompt]}` with ids `builtin-{category}-{index:03d}`, no system prompt, source
        "builtin"; dialogue items have two turns, the others one.

    Raises:
        ValueError: On a negative `n_per_suite`, or when a suite runs out of distinct texts.
    """
    if n_per_suite < 0:
        raise ValueError(f"n_per_suite must be >= 0, got {n_per_suite}")
    return {category: _suite(category, n_per_suite, seed) for category in CATEGORIES}


def _suite(category: str, n: int, seed: int) -> list[BenchPrompt]:
    rng = random.Random(f"draftsmith-evals:{seed}:{category}")
    seen: set[str] = set()
    items: list[BenchPrompt] = []
    for index in range(n):
        for _ in range(_MAX_ATTEMPTS):
            turns = _GENERATORS[category](rng)
            key = dedupe_key(None, turns)
            if key not in seen:
                break
        else:
            raise ValueError(f"built-in suite {category!r} has no distinct item left after {index} items")
        seen.add(key)
        items.append(BenchPrompt(id=f"builtin-{category}-{index:03d}", category=category, turns=turns, source=SOURCE))
    return items
