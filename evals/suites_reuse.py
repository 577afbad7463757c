"""Built-in suites of requests whose answers reuse the prompt: complete a function, answer with the numbers
of a text, edit or summarise a passage, and a follow-up that reworks the first answer.

These are the requests where copying pays (the target repeats a signature, a figure, most of a passage), so
they measure what an n-gram drafter gets for free and whether a trained drafter learned to copy. Like the
other suites (`evals/suites.py`) they are written for evaluation only: every item carries at least one term
of `REUSE_ONLY_TERMS`, which no training generator contains.
"""

from __future__ import annotations

import random
from collections.abc import Callable

# Eval-only vocabulary: none of these strings may occur in the training generators (a unit test checks).
_PEOPLE = "Wilhelmina|Casimir|Philippa|Lysander|Ottoline|Evander|Rosalind Okafor|Benedikt|Seraphina".split("|")
_PLACES = "Quillbury|Thornwick|Marrowfield|Bexhollow|Glenmoraig|Saltcombe Vale|Pennyrigg|Larkspur Bay".split("|")
_WARES = "harmonicas|teapots with spouts|chess clocks|beeswax candles|brass compasses|tin whistles".split("|")
_EVENTS = "the lantern festival|the regatta|the cheese fair|the kite contest|the choir concert".split("|")
_FUNCS: tuple[tuple[str, str, str, str], ...] = (
    # (name, signature, contract, doctest lines)
    (
        "tally_harmonicas",
        "(orders: list[tuple[str, int]]) -> int",
        "Return how many harmonicas were ordered in total; each order is (item, quantity).",
        ">>> tally_harmonicas([('harmonica', 3), ('kazoo', 2), ('harmonica', 1)])\n    4",
    ),
    (
        "quillbury_postcode",
        "(street_number: int) -> str",
        "Return the Quillbury postcode for a street number: 'QB-' followed by the number padded to 4 digits.",
        ">>> quillbury_postcode(42)\n    'QB-0042'",
    ),
    (
        "regatta_winner",
        "(times: dict[str, float]) -> str",
        "Return the name of the crew with the lowest finishing time in the regatta.",
        ">>> regatta_winner({'Thornwick': 412.5, 'Bexhollow': 398.2})\n    'Bexhollow'",
    ),
    (
        "teapot_capacity",
        "(cups: int, cup_ml: int = 250) -> float",
        "Return the litres a teapot must hold to pour the given number of cups.",
        ">>> teapot_capacity(6)\n    1.5",
    ),
    (
        "chess_clock_left",
        "(start_s: int, moves: list[int]) -> int",
        "Return the seconds left on a chess clock after the moves, each given in seconds used.",
        ">>> chess_clock_left(300, [12, 40, 7])\n    241",
    ),
    (
        "candle_hours",
        "(grams: int, burn_rate: float) -> float",
        "Return how many hours a beeswax candle of the given weight burns at burn_rate grams per hour.",
        ">>> candle_hours(180, 7.5)\n    24.0",
    ),
    (
        "compass_heading",
        "(degrees: float) -> str",
        "Return the nearest of the eight compass points (N, NE, E, ...) for a heading in degrees.",
        ">>> compass_heading(100)\n    'E'",
    ),
    (
        "marrowfield_fare",
        "(zones: int, child: bool) -> float",
        "Return the Marrowfield bus fare: 1.80 per zone, half price for a child.",
        ">>> marrowfield_fare(3, True)\n    2.7",
    ),
    (
        "choir_sections",
        "(singers: list[str], size: int) -> list[list[str]]",
        "Split the choir's singers into sections of at most size singers, in order.",
        ">>> choir_sections(['Philippa', 'Evander', 'Casimir'], 2)\n    [['Philippa', 'Evander'], ['Casimir']]",
    ),
    (
        "kite_line_length",
        "(height_m: float, angle_deg: float) -> float",
        "Return the kite line needed to fly at height_m with the line at angle_deg above the ground.",
        ">>> round(kite_line_length(30, 30), 1)\n    60.0",
    ),
)

REUSE_ONLY_TERMS: tuple[str, ...] = tuple(
    dict.fromkeys([*_PEOPLE, *_PLACES, *_WARES, *_EVENTS, *(f[0] for f in _FUNCS)])
)

_STUB_ASKS = (
    "Complete this Python function:",
    "Write the body of this function and reply with the complete function:",
    "Implement the following function so that its example passes:",
    "Please implement this stub:",
    "Finish the code below. Keep the signature and the docstring as they are.",
    "Replace the placeholder with a working implementation:",
)


def _stub(rng: random.Random) -> str:
    name, signature, contract, example = rng.choice(_FUNCS)
    tail = rng.choice(("    pass", "    # your code here", "    ..."))
    return f'def {name}{signature}:\n    """{contract}\n\n    {example}\n    """\n{tail}'


def _completion(rng: random.Random) -> list[str]:
    stub = _stub(rng)
    if rng.random() < 0.7:
        return [f"{rng.choice(_STUB_ASKS)}\n\n```python\n{stub}\n```"]
    return [
        f"Here is the start of a function.\n\n```python\n{stub}\n```\n\nFinish it and add two more doctest examples."
    ]


def _extraction(rng: random.Random) -> list[str]:
    who, other = rng.sample(_PEOPLE, 2)
    place, wares, event = rng.choice(_PLACES), rng.choice(_WARES), rng.choice(_EVENTS)
    sold, stock, price = rng.randint(40, 400), rng.randint(401, 900), rng.randint(3, 40)
    day, visitors = rng.randint(1, 28), rng.randint(1200, 9800)
    text = rng.choice(
        (
            f"At {event} in {place} on day {day}, {who} sold {sold} {wares} at ${price} each out of a stock of "
            f"{stock}. {other} counted {visitors} visitors.",
            f"{place} report: {visitors} people attended {event}. {who}'s stall had {stock} {wares} and sold {sold}; "
            f"{other} ran the stall next door for {day} hours.",
        )
    )
    ask = rng.choice(
        (
            f"How many {wares} were left unsold?",
            f"What did {who} earn from the {wares}?",
            "List every number in the text and say what it counts.",
            "How many visitors were there, and who counted them?",
            "Answer with the numbers from the text: what share of the stock was sold?",
        )
    )
    return [rng.choice((f"{text}\n\n{ask}", f"Text: {text}\nQuestion: {ask}"))]


_PASSAGES = (
    "The ferry to {place} leaves twice a day in summer. {who} has sailed it for eleven years and knows every "
    "passenger by name. On windy days the crossing takes longer, and the cafe on board sells out of tea.",
    "{who} restores {wares} in a small workshop in {place}. Most of them arrive broken, some with missing parts. "
    "Each one takes about a week, and the finished pieces are sold at {event}.",
    "Every spring, {place} holds {event}. The whole town helps: {who} organises the stalls, the school paints "
    "the signs, and the bakery stays open late. Last year it rained, but people came anyway.",
)
_EDIT_ASKS = (
    "Correct any mistakes in this paragraph and change nothing else:",
    "Rewrite this paragraph in the past tense:",
    "Summarise this paragraph in one sentence:",
    "Make this paragraph sound more formal:",
    "Turn this paragraph into three bullet points:",
    "Shorten this paragraph to about half its length:",
)


def _editing(rng: random.Random) -> list[str]:
    passage = rng.choice(_PASSAGES).format(
        place=rng.choice(_PLACES), who=rng.choice(_PEOPLE), wares=rng.choice(_WARES), event=rng.choice(_EVENTS)
    )
    return [f"{rng.choice(_EDIT_ASKS)}\n\n{passage}"]


_OPENERS = (
    "Write a Python function named {func} that {does}.",
    "Write a short invitation from {who} to {event} in {place}.",
    "List four things a visitor to {place} should pack.",
    "Write three sentences describing {who}'s stall of {wares}.",
)
_DOES = (
    "returns the total price of a list of harmonicas|checks whether a chess clock has run out|converts a "
    "compass heading to a direction name"
).split("|")
_REWORKS = (
    "Now repeat that, adding a comment to each line.|Repeat your answer word for word, then add one more "
    "sentence at the end.|Give the same answer again as a numbered list.|Keep your answer but make it shorter."
).split("|")


def _followup(rng: random.Random) -> list[str]:
    who, other = rng.sample(_PEOPLE, 2)
    opener = rng.choice(_OPENERS)
    first = opener.format(
        func=rng.choice(_FUNCS)[0],
        does=rng.choice(_DOES),
        who=who,
        event=rng.choice(_EVENTS),
        place=rng.choice(_PLACES),
        wares=rng.choice(_WARES),
    )
    # A rename only makes sense when the first answer was asked to name someone.
    renames = (f"Rewrite your answer so that {who} is replaced by {other} everywhere.",) if "{who}" in opener else ()
    return [first, rng.choice((*_REWORKS, *renames))]


GENERATORS: dict[str, Callable[[random.Random], list[str]]] = {
    "completion": _completion,
    "extraction": _extraction,
    "editing": _editing,
    "followup": _followup,
}
