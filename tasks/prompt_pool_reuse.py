"""Synthetic prompts whose answers reuse what the prompt holds: code to complete or fix, numbers and names to
pick out of a text, a passage to edit, and follow-ups that rework the first answer.

Real requests carry material the answer copies (a function stub, a report, a draft to polish, the previous
turn). A drafter trained only on prompts that carry none learns to guess the target's phrasing but not to
copy, which is where a drafter pays most. These generators give the synthetic pool (`prompt_pool`) four
categories of such prompts: `completion`, `extraction`, `editing` and `followup`.

Every string here belongs to the training side: the built-in evaluation suites (`evals/suites.py`) use their
own templates and an eval-only vocabulary that must not occur in this module either (a unit test checks).
"""

from __future__ import annotations

import random
from collections.abc import Callable

from draftsmith.tasks import prompt_material as material
from draftsmith.tasks.prompt_code import FunctionSpec, composed

# --------------------------------------------------------------------------------------------------
# Code stubs: a function's contract and a way to compute an example call, so that every stub's doctest holds.
# Half are these fixed contracts (real algorithms); half are composed anew (`prompt_code`), for names to copy.

COMPOSED_SHARE = 0.5


def _ints(rng: random.Random, n: int, lo: int = -9, hi: int = 30) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(n)]


def _words(rng: random.Random, n: int) -> list[str]:
    return rng.sample(_WORDS, n)


_WORDS = (
    "apple river stone cloud pencil garden window ladder candle forest silver harbor meadow rocket "
    "violet anchor bridge castle desert engine falcon glacier island jungle kettle lantern marble "
    "needle orchard pepper quartz saddle tunnel velvet walnut yellow zephyr basket copper dolphin"
).split()

_SPECS: tuple[FunctionSpec, ...] = (
    FunctionSpec(
        ("sum_even", "total_of_evens", "even_sum"),
        (("numbers", "list[int]"),),
        "int",
        "Return the sum of the even numbers in {0}.",
        lambda r: ((x := _ints(r, 6),), sum(v for v in x if v % 2 == 0)),
        "    return sum(n for n in numbers if n % 2 == 0)",
    ),
    FunctionSpec(
        ("count_above", "num_greater_than", "count_over"),
        (("values", "list[int]"), ("limit", "int")),
        "int",
        "Return how many items of {0} are strictly greater than {1}.",
        lambda r: ((x := _ints(r, 7), t := r.randint(0, 20)), sum(v > t for v in x)),
        "    return sum(1 for v in values if v > limit)",
    ),
    FunctionSpec(
        ("longest_word", "find_longest", "max_length_word"),
        (("words", "list[str]"),),
        "str",
        "Return the longest string in {0}; on a tie, the first one.",
        lambda r: ((x := _words(r, 5),), max(x, key=len)),
        "    best = ''\n    for word in words:\n        if len(word) > len(best):\n"
        "            best = word\n    return best",
    ),
    FunctionSpec(
        ("running_total", "cumulative_sum", "prefix_sums"),
        (("numbers", "list[int]"),),
        "list[int]",
        "Return the running totals of {0}: item i is the sum of the first i + 1 numbers.",
        lambda r: ((x := _ints(r, 5, 0, 9),), [sum(x[: i + 1]) for i in range(len(x))]),
        "    out, total = [], 0\n    for n in numbers:\n        total += n\n        out.append(total)\n    return out",
    ),
    FunctionSpec(
        ("clamp", "clip_value", "bound"),
        (("value", "int"), ("low", "int"), ("high", "int")),
        "int",
        "Return {0} limited to the range from {1} to {2}, inclusive.",
        lambda r: ((v := r.randint(-20, 40), lo := r.randint(0, 5), hi := r.randint(10, 20)), min(max(v, lo), hi)),
        "    return max(low, min(value, high))",
    ),
    FunctionSpec(
        ("word_lengths", "lengths_of_words", "measure_words"),
        (("sentence", "str"),),
        "list[int]",
        "Return the length of every space-separated word in {0}, in order.",
        lambda r: ((s := " ".join(_words(r, 4)),), [len(w) for w in s.split()]),
        "    return [len(word) for word in sentence.split()]",
    ),
    FunctionSpec(
        ("dedupe", "unique_in_order", "remove_repeats"),
        (("items", "list[int]"),),
        "list[int]",
        "Return {0} without repeated values, keeping the first occurrence of each.",
        lambda r: ((x := _ints(r, 8, 1, 6),), list(dict.fromkeys(x))),
        "    seen = set()\n    out = []\n    for item in items:\n        if item not in seen:\n"
        "            seen.add(item)\n            out.append(item)\n    return out",
    ),
    FunctionSpec(
        ("chunk", "split_into_groups", "batches"),
        (("items", "list[int]"), ("size", "int")),
        "list[list[int]]",
        "Split {0} into consecutive groups of {1} items; the last group may be shorter.",
        lambda r: ((x := _ints(r, 7, 0, 9), k := r.randint(2, 3)), [x[i : i + k] for i in range(0, len(x), k)]),
        "    return [items[i : i + size] for i in range(0, len(items), size)]",
    ),
    FunctionSpec(
        ("count_vowels", "vowel_count", "num_vowels"),
        (("text", "str"),),
        "int",
        "Return the number of vowels (a, e, i, o, u, either case) in {0}.",
        lambda r: ((s := " ".join(_words(r, 3)).title(),), sum(c in "aeiouAEIOU" for c in s)),
        "    return sum(1 for ch in text.lower() if ch in 'aeiou')",
    ),
    FunctionSpec(
        ("is_sorted", "in_order", "check_ascending"),
        (("numbers", "list[int]"),),
        "bool",
        "Return True if {0} is in non-decreasing order, else False.",
        lambda r: ((x := sorted(_ints(r, 5)) if r.random() < 0.5 else _ints(r, 5),), x == sorted(x)),
        "    return all(a <= b for a, b in zip(numbers, numbers[1:]))",
    ),
    FunctionSpec(
        ("swap_pairs", "flip_pairs", "exchange_neighbours"),
        (("items", "list[int]"),),
        "list[int]",
        "Return {0} with each pair of neighbours swapped: items 0 and 1, 2 and 3, and so on.",
        lambda r: ((x := _ints(r, 6, 0, 9),), [v for i in range(0, 6, 2) for v in (x[i + 1], x[i])]),
        "    out = list(items)\n    for i in range(0, len(out) - 1, 2):\n"
        "        out[i], out[i + 1] = out[i + 1], out[i]\n    return out",
    ),
    FunctionSpec(
        ("initials", "make_initials", "name_initials"),
        (("full_name", "str"),),
        "str",
        "Return the capitalised first letter of each word in {0}, joined with dots.",
        lambda r: ((s := " ".join(_words(r, 3)),), ".".join(w[0].upper() for w in s.split())),
        "    return '.'.join(part[0].upper() for part in full_name.split())",
    ),
    FunctionSpec(
        ("max_gap", "largest_step", "biggest_difference"),
        (("numbers", "list[int]"),),
        "int",
        "Return the largest absolute difference between two neighbouring items of {0}.",
        lambda r: ((x := _ints(r, 6),), max(abs(a - b) for a, b in zip(x, x[1:], strict=False))),
        "    return max(abs(a - b) for a, b in zip(numbers, numbers[1:]))",
    ),
    FunctionSpec(
        ("count_words", "word_frequencies", "tally_words"),
        (("text", "str"),),
        "dict[str, int]",
        "Return how often each space-separated word occurs in {0}.",
        lambda r: ((s := " ".join(r.choices(_words(r, 3), k=5)),), {w: s.split().count(w) for w in s.split()}),
        "    counts = {}\n    for word in text.split():\n"
        "        counts[word] = counts.get(word, 0) + 1\n    return counts",
    ),
    FunctionSpec(
        ("rotate_left", "shift_left", "rotate_items"),
        (("items", "list[int]"), ("steps", "int")),
        "list[int]",
        "Return {0} rotated {1} places to the left.",
        lambda r: ((x := _ints(r, 5, 0, 9), k := r.randint(1, 4)), x[k:] + x[:k]),
        "    if not items:\n        return []\n    steps %= len(items)\n    return items[steps:] + items[:steps]",
    ),
    FunctionSpec(
        ("digit_sum", "sum_of_digits", "add_digits"),
        (("number", "int"),),
        "int",
        "Return the sum of the decimal digits of the non-negative integer {0}.",
        lambda r: ((n := r.randint(10, 99999),), sum(int(d) for d in str(n))),
        "    total = 0\n    while number:\n        total += number % 10\n        number //= 10\n    return total",
    ),
)

_LANG_STYLES = ("Python", "Python", "Python", "JavaScript", "TypeScript")
_STUB_ASKS = (
    "Complete the following {lang} function.",
    "Finish this {lang} function so that it does what its comment says.",
    "Implement the body of this {lang} function. Reply with the whole function.",
    "Write the missing code for this {lang} function.",
    "Fill in this {lang} function.",
)
_CODE_ASKS = (
    "This {lang} function has a bug. Find it and give the corrected function.",
    "Add comments to this {lang} function that explain each step.",
    "Add a docstring and type hints to this function.",
    "Rename the variables in this function to clearer names and return the whole function.",
    "Rewrite this {lang} function without changing what it does, but make it easier to read.",
    "Explain line by line what this {lang} function does.",
    "Write three unit tests for this {lang} function.",
)
_BUGS = ((" > ", " >= "), (" + 1", ""), ("min(", "max("), (" == 0", " == 1"), ("[1:]", "[2:]"), ("out", "result"))


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


def _py_stub(spec: FunctionSpec, name: str, rng: random.Random, *, body: str | None) -> str:
    params = [p for p, _ in spec.params]
    args, result = spec.example(rng)
    signature = ", ".join(f"{p}: {t}" for p, t in spec.params)
    call = f"{name}({', '.join(repr(a) for a in args)})"
    doc = spec.doc.format(*params)
    lines = [f"def {name}({signature}) -> {spec.returns}:", f'    """{doc}', "", f"    >>> {call}", f"    {result!r}"]
    lines.append('    """')
    lines.append(body if body is not None else rng.choice(("    # TODO", "    pass", "    ...")))
    return "\n".join(lines)


def _js_stub(spec: FunctionSpec, name: str, rng: random.Random, typed: bool) -> str:
    args, result = spec.example(rng)
    ts = {"int": "number", "str": "string", "bool": "boolean", "list[int]": "number[]", "list[str]": "string[]"}
    params = ", ".join(f"{p}: {ts.get(t, 'any')}" if typed else p for p, t in spec.params)
    doc = spec.doc.format(*(p for p, _ in spec.params))
    call = f"{_camel(name)}({', '.join(repr(a).replace('True', 'true').replace('False', 'false') for a in args)})"
    shown = repr(result).replace("True", "true").replace("False", "false")
    return (
        f"/**\n * {doc}\n * Example: {call} returns {shown}\n */\nfunction {_camel(name)}({params}) {{\n  // TODO\n}}"
    )


def _completion(rng: random.Random) -> list[str]:
    spec = composed(rng) if rng.random() < COMPOSED_SHARE else rng.choice(_SPECS)
    name, lang = rng.choice(spec.names), rng.choice(_LANG_STYLES)
    if lang != "Python":
        return [
            f"{rng.choice(_STUB_ASKS).format(lang=lang)}\n\n```{lang.lower()}\n"
            f"{_js_stub(spec, name, rng, lang == 'TypeScript')}\n```"
        ]
    if rng.random() < 0.6:
        return [f"{rng.choice(_STUB_ASKS).format(lang=lang)}\n\n```python\n{_py_stub(spec, name, rng, body=None)}\n```"]
    body = spec.body
    ask = rng.choice(_CODE_ASKS)
    if "bug" in ask:
        old, new = next(((a, b) for a, b in rng.sample(_BUGS, len(_BUGS)) if a in body), ("return ", "return -"))
        body = body.replace(old, new, 1)
    return [f"{ask.format(lang=lang)}\n\n```python\n{_py_stub(spec, name, rng, body=body)}\n```"]


# --------------------------------------------------------------------------------------------------
# Texts with numbers and names to pick out.

_PEOPLE = "Anna|Ben|Carla|David|Emma|Felix|Greta|Hugo|Iris|Jonas|Karin|Liam|Mona|Nils|Olga|Pablo".split("|")
_GOODS = "chairs|lamps|bicycles|laptops|umbrellas|blankets|mugs|backpacks|helmets|jackets".split("|")
_MONTHS = "January|February|March|April|May|June|July|August|September|October|November|December".split("|")
_TEAMS = "the red team|the blue team|the night shift|the sales office|the north depot|the design group".split("|")


def _report(rng: random.Random) -> tuple[str, list[str]]:
    """A short report holding several numbers and names, and the questions it can answer."""
    town, (a, b, c) = material.town(rng), [material.person(rng) for _ in range(3)]
    g1, g2 = rng.sample(_GOODS, 2) if rng.random() < 0.3 else (material.thing(rng), material.thing(rng))
    m1, m2 = rng.sample(_MONTHS, 2)
    n1 = rng.randint(60, 480)
    n2, n3 = rng.randint(10, n1 // 2), rng.randint(3, n1 // 4)
    price, year = rng.randint(5, 90), rng.randint(1990, 2024)
    kind = rng.randrange(3)
    if kind == 0:
        text = (
            f"The shop in {town} opened in {year}. In {m1} it sold {n1} {g1} and {n2} {g2}. {a} ran the shop "
            f"while {b} handled deliveries, and {n3} orders were returned. Each of the {g1} cost ${price}."
        )
        asks = [
            f"How many {g1} and {g2} were sold in {m1}?",
            f"What was the revenue from the {g1}?",
            "Who handled deliveries, and how many orders were returned?",
            "In what year did the shop open?",
        ]
    elif kind == 1:
        text = (
            f"Survey results for {town}: {n1} residents answered. {n2} said they cycle to work, {n3} take the "
            f"bus, and the rest drive. {a} led the survey in {m1} {year}, and {b} and {c} checked the answers."
        )
        asks = [
            "How many residents answered, and how many cycle?",
            "Who led the survey, and when?",
            "How many residents drive? Show the calculation.",
            "List every number in the text and what it counts.",
        ]
    else:
        text = (
            f"Meeting notes, {m1} {rng.randint(1, 28)}: {rng.choice(_TEAMS)} shipped {n1} {g1}, {n2} fewer "
            f"than planned. {a} will order {n3} more {g2} by {m2}. {b} reported {rng.randint(2, 9)} open issues "
            f"and a budget of ${n1 * price}."
        )
        asks = [
            f"What will {a} order, and by when?",
            f"What budget did {b} report?",
            "Turn these notes into a list of action items with owners.",
            "Which numbers appear in the notes?",
        ]
    return text, asks


_EXTRACT_FORMS = (
    "{text}\n\n{ask}",
    "Read the text and answer the question using the numbers it gives.\n\nText: {text}\n\nQuestion: {ask}",
    "{ask} Use only the information below.\n\n{text}",
    'Here is a note: "{text}"\n{ask}',
)


_NOTE_ASKS = (
    "List every name, number and code in the text.",
    "Who is mentioned, and what did each of them do?",
    "Which towns appear in the text, and what happened in each?",
    "Put the figures in the text into a table.",
    "Which order or part codes are mentioned, and what happened to each?",
)


def _extraction(rng: random.Random) -> list[str]:
    # Half the texts are fresh material throughout: nothing in them recurs, so an answer can only copy it.
    text, asks = _report(rng) if rng.random() < 0.5 else (material.passage(rng, 2, 3), list(_NOTE_ASKS))
    return [rng.choice(_EXTRACT_FORMS).format(text=text, ask=rng.choice(asks))]


# --------------------------------------------------------------------------------------------------
# Passages to edit.

_OPENINGS = (
    "Our team moved into a new office last spring.|The local library started a reading club for adults.|"
    "The river near the village flooded twice this year.|My uncle repairs old radios in his garage.|"
    "The city council approved a plan for new bike lanes.|A small bakery opened next to the train station.|"
    "The school garden produced more vegetables than expected.|Our neighbour built a treehouse for her kids."
).split("|")
_MIDDLES = (
    "At first, nobody knew how it would work out.|It took several weeks to get everything ready.|"
    "Many people came to help on the weekends.|The costs were higher than the first estimate.|"
    "Some residents worried about the noise.|The weather made the work slower than planned.|"
    "Everyone agreed that the result was worth the effort.|A few problems had to be solved along the way."
).split("|")
_CLOSINGS = (
    "Now it is one of the busiest places in town.|Next year, the organisers want to do even more.|"
    "The project will be reviewed again in the autumn.|People still talk about it at the market.|"
    "It has become a small tradition for the whole street.|The next step is to find more volunteers."
).split("|")
_EDIT_ASKS = (
    "Fix the spelling mistakes in this paragraph:",
    "Correct the grammar and spelling, and change nothing else:",
    "Rewrite this paragraph in the past tense:",
    "Make this paragraph more formal:",
    "Make this paragraph shorter without losing any facts:",
    "Summarise this paragraph in one sentence:",
    "Turn this paragraph into a bulleted list:",
    "Rewrite this paragraph for a young child:",
    "Give this paragraph a title, then repeat it unchanged:",
    "Rewrite this paragraph in the first person:",
)


def _typos(text: str, rng: random.Random) -> str:
    words = text.split(" ")
    for i in rng.sample(range(len(words)), k=min(3, len(words))):
        w = words[i]
        if len(w) > 4 and w.isalpha():
            j = rng.randrange(1, len(w) - 2)
            words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2 :]
    return " ".join(words)


def _editing(rng: random.Random) -> list[str]:
    if rng.random() < 0.75:
        passage = material.passage(rng, 3, 3)
    else:
        passage = " ".join([rng.choice(_OPENINGS), *rng.sample(_MIDDLES, rng.randint(1, 2)), rng.choice(_CLOSINGS)])
    ask = rng.choice(_EDIT_ASKS)
    if "spelling" in ask:
        passage = _typos(passage, rng)
    return [f"{ask}\n\n{passage}" if rng.random() < 0.7 else f'{ask} "{passage}"']


# --------------------------------------------------------------------------------------------------
# Follow-ups that rework the first answer.

_FIRST_ASKS = (
    "Write a Python function that {task}.",
    "List five {things}.",
    "Write a short paragraph about {topic}.",
    "Give me a step-by-step plan for {goal}.",
    "Write a short email inviting {person} to {event}.",
)
_TASKS = (
    "returns the largest of three numbers|counts how many times a letter appears in a word|checks whether "
    "a year is a leap year|reverses the order of words in a sentence|returns the average of a list"
).split("|")
_THINGS = (
    "fruits that are rich in vitamin C|tips for saving energy at home|board games for families|ways to learn a "
    "new word every day"
).split("|")
_TOPICS = "why trees matter in cities|how a bicycle works|the history of the postcard|why people keep diaries".split(
    "|"
)
_GOALS = "cleaning a messy garage|learning to swim as an adult|planning a picnic|starting a vegetable patch".split("|")
_EVENTS = "a birthday dinner|a team lunch on Friday|a garden party|a book club meeting".split("|")
_REWORKS = (
    "Now add a comment to every line of that code.|Rewrite the same function in JavaScript.|"
    "Repeat your answer, but sort the items alphabetically.|Repeat your answer with each item numbered.|"
    "Make your answer half as long and keep the important parts.|Rewrite your answer in a more formal tone.|"
    "Repeat your answer, but replace the last point with a new one.|Put your answer into a table.|"
    "Add a short title to your answer and repeat it.|Change the names in your answer and keep everything else."
).split("|")


# The reworks that apply to prose (the others ask about code).
_TEXT_REWORKS = [r for r in _REWORKS if "code" not in r and "function" not in r]
_NOTES_ASKS = (
    "Turn these notes into a short email to {person}.",
    "Write these notes up as a tidy list.",
    "Summarise these notes in two sentences.",
    "Rewrite these notes as a short report with a title.",
)


def _followup(rng: random.Random) -> list[str]:
    if rng.random() < 0.5:  # the first turn carries fresh material, so both answers must copy it
        ask = rng.choice(_NOTES_ASKS).format(person=material.person(rng))
        return [f"Here are my notes:\n\n{material.passage(rng, 2, 3)}\n\n{ask}", rng.choice(_TEXT_REWORKS)]
    first = rng.choice(_FIRST_ASKS).format(
        task=rng.choice(_TASKS),
        things=rng.choice(_THINGS),
        topic=rng.choice(_TOPICS),
        goal=rng.choice(_GOALS),
        person=rng.choice(_PEOPLE),
        event=rng.choice(_EVENTS),
    )
    return [first, rng.choice(_REWORKS)]


GENERATORS: dict[str, Callable[[random.Random], list[str]]] = {
    "completion": _completion,
    "extraction": _extraction,
    "editing": _editing,
    "followup": _followup,
}
