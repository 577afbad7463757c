"""Material for the reuse prompts that no drafter can have memorised: people, places, figures, codes and
sentences composed from many independent slots.

A reuse prompt teaches copying only if its material is new to the drafter. Passages, reports and first turns
built from a few fixed sentences and names recur across hundreds of training prompts: the drafter then learns
them by heart, predicts them from memory, and never learns to look them up in the context, so on a new request
it fails exactly where prompt lookup succeeds (`draftsmith doctor`'s `copying` check measures that). Here every
sentence draws its slots independently (about 10^4 people, 10^3 towns, 10^6 order codes), so two prompts
almost never share a passage and the only way to predict the material in an answer is to copy it.

Every string here belongs to the training side, like `prompt_pool_reuse`'s (the evaluation suites' eval-only
vocabulary must not occur here; a unit test checks).
"""

from __future__ import annotations

import random

_FIRST = (
    "Adele Bruno Cecile Dorian Elsa Fabian Gisela Henrik Ilse Jasper Kerstin Leopold Marta Niklas Ottilie Pieter "
    "Quentin Rosalind Sven Tamsin Ulrich Vera Wendell Xenia Yannick Zora Aurelio Brigid Cosmo Delphine Edmund "
    "Fenna Gustav Helka Ignatius Joelle Konrad Lotte Mattias Nerys"
).split()
_LAST = (
    "Abernathy Brandt Castellano Drummond Eklund Fairweather Grimaldi Haverford Ingram Jankowski Kowalczyk "
    "Lindqvist Marchetti Novak Oyelaran Pemberton Quist Rasmussen Szabo Thorvald Underhill Vasquez Whitcombe "
    "Yilmaz Zeller Ashdown Bellamy Crowther Dunmore Esposito Fitzroy Galloway Holmberg Iwasaki Jessop Kessler"
).split()
_TOWN_HEAD = "Ash Birch Cold Elm Fern Glen Hazel Iron Lark Maple North Pine Red Salt Thorn West Wolf Yew Brook Cross"
_TOWN_TAIL = "ford bury dale field gate haven holm ley mere mouth stead wick worth ton by combe hurst minster"
_THINGS = (
    "crates|pallets|ladders|kettles|radiators|tyres|microscopes|violins|tents|printers|sofas|"
    "scooters|telescopes|shovels|pianos|kayaks|blenders|wardrobes|easels|tripods|toasters|hammocks|lawnmowers|"
    "barrels|saddles|anvils|sewing machines|solar panels|fire extinguishers|filing cabinets|road signs|"
    "garden benches|bookshelves|water pumps|desk lamps|ceiling fans|bread ovens|drum kits|canoes|trolleys"
).split("|")
_PLACES = (
    "the east warehouse|the harbour office|the old mill|the loading bay|the print room|the north annex|"
    "the repair shop|the county depot|the train yard|the river dock|the town hall basement|the market hall"
).split("|")
_VERBS = "ordered|repaired|delivered|counted|painted|sold|packed|returned|inspected|labelled|shipped|stored"
_STATUSES = "approved|cancelled|delayed|split in two|sent back|paid in full|put on hold|confirmed twice"
_WEEKDAYS = "Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split()
_MONTHS = "January February March April May June July August September October November December".split()
_EVENTS = "stock count|open day|safety audit|spring fair|board meeting|charity auction|staff outing|move"


def person(rng: random.Random) -> str:
    return f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"


def town(rng: random.Random) -> str:
    return rng.choice(_TOWN_HEAD.split()) + rng.choice(_TOWN_TAIL.split())


def thing(rng: random.Random) -> str:
    return rng.choice(_THINGS)


def code(rng: random.Random) -> str:
    """An order or part code such as `KX-40718`: letters and digits no tokenizer has a word for."""
    letters = "".join(rng.choice("ABCDEFGHJKLMNPRSTVWXZ") for _ in range(2))
    return f"{letters}-{rng.randint(10000, 99999)}"


def clock(rng: random.Random) -> str:
    return f"{rng.randint(6, 19)}:{rng.choice(('00', '15', '20', '30', '40', '45', '50'))}"


def sentence(rng: random.Random) -> str:
    """One sentence of a report or note, every slot drawn anew."""
    a, b = person(rng), person(rng)
    n, m = rng.randint(3, 480), rng.randint(2, 60)
    forms = (
        lambda: (
            f"{a} {rng.choice(_VERBS.split('|'))} {n} {thing(rng)} at {rng.choice(_PLACES)} in {town(rng)} "
            f"on {rng.choice(_WEEKDAYS)}."
        ),
        lambda: (
            f"On {rng.choice(_MONTHS)} {rng.randint(1, 28)}, {a} moved {n} {thing(rng)} from {town(rng)} "
            f"to {town(rng)}."
        ),
        lambda: f"Order {code(rng)} for {n} {thing(rng)} was {rng.choice(_STATUSES.split('|'))} by {a}.",
        lambda: f"{a} and {b} met in {town(rng)} at {clock(rng)} to plan the {rng.choice(_EVENTS.split('|'))}.",
        lambda: f"The {n} {thing(rng)} cost ${rng.randint(4, 900)} each, {m} more than in {rng.randint(1995, 2025)}.",
        lambda: f"{a}'s team in {town(rng)} finished {m} of the {n + m} {thing(rng)} before {clock(rng)}.",
        lambda: f"{b} asked {a} to check part {code(rng)} and to call back before {rng.choice(_WEEKDAYS)}.",
        lambda: f"In {town(rng)}, {n} people signed up for the {rng.choice(_EVENTS.split('|'))} and {m} came late.",
    )
    return rng.choice(forms)()


def passage(rng: random.Random, lo: int = 2, hi: int = 4) -> str:
    """`lo` to `hi` sentences of fresh material."""
    return " ".join(sentence(rng) for _ in range(rng.randint(lo, hi)))
