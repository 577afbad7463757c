"""Code stubs for the `completion` prompts: the fixed contracts' shape (`FunctionSpec`), and functions composed
anew for every prompt, whose names no drafter can have memorised.

A function's identifiers recur through its answer: the parameter in every loop, the accumulator on every line.
With a few fixed stubs (`sum_even(numbers)`) the drafter learns those names by heart and never learns to copy a
name from the context, which is what code on a new request needs (`draftsmith doctor`'s `copying` check finds
coding the suite where it copies worst). `composed` draws a parameter name from two slots (`sensor_readings`,
`ticket_fees`), then a filter, a map and a reduction, each with its own constants: about 10^5 contracts whose
docstring example is computed, so that it always holds.

Every string here belongs to the training side (the evaluation suites' eval-only vocabulary must not occur
here; a unit test checks).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class FunctionSpec:
    names: tuple[str, ...]  # function names (snake_case); camelCase is derived for other languages
    params: tuple[tuple[str, str], ...]  # (name, Python type)
    returns: str  # Python return type
    doc: str  # one-line contract; {0}, {1} name the parameters
    example: Callable[[random.Random], tuple[tuple, object]]  # arguments and the result
    body: str  # a reference body (Python), indented by four spaces, used by fix/annotate prompts


_QUALIFIERS = "sensor daily monthly user batch order station shelf route client ticket store team trip field".split()
_NOUNS = (
    "readings prices ages weights counts sizes depths speeds votes heights ranks loads fees balances "
    "distances durations ratings volumes scores payments"
).split()
_KEPT = "kept picked chosen matching selected valid useful".split()


@dataclass(frozen=True)
class _Step:
    code: str  # Python text; `{x}` is the item, `{k}` the constant, `{v}` (reductions) the kept list
    words: str  # the step in the docstring; `{k}` is the constant
    draw: Callable[[random.Random], int]  # the constant
    run: Callable[[int, int], int]  # what `code` computes, on an item and the constant


_FILTERS = (
    _Step("{x} > {k}", "that are greater than {k}", lambda r: r.randint(0, 15), lambda x, k: x > k),
    _Step("{x} < {k}", "that are less than {k}", lambda r: r.randint(5, 20), lambda x, k: x < k),
    _Step("{x} >= {k}", "that are at least {k}", lambda r: r.randint(0, 15), lambda x, k: x >= k),
    _Step("{x} % {k} == 0", "that are divisible by {k}", lambda r: r.randint(2, 5), lambda x, k: x % k == 0),
    _Step("{x} != {k}", "that differ from {k}", lambda r: r.randint(0, 9), lambda x, k: x != k),
)
_MAPS = (
    _Step("{x} * {k}", "multiply each by {k}", lambda r: r.randint(2, 9), lambda x, k: x * k),
    _Step("{x} + {k}", "add {k} to each", lambda r: r.randint(1, 20), lambda x, k: x + k),
    _Step("{x} - {k}", "subtract {k} from each", lambda r: r.randint(1, 20), lambda x, k: x - k),
    _Step("{x} * {x}", "square each", lambda r: 0, lambda x, k: x * x),
    _Step("abs({x})", "take the absolute value of each", lambda r: 0, lambda x, k: abs(x)),
)
_KEEP_ALL = _Step("", "", lambda r: 0, lambda x, k: True)
_SAME = _Step("{x}", "", lambda r: 0, lambda x, k: x)
# (reduction of the kept list `{v}`, its words, Python return type, the name's verb, what it computes)
_REDUCES: tuple[tuple[str, str, str, str, Callable[[list[int]], object]], ...] = (
    ("sum({v})", "return their sum", "int", "total", sum),
    ("max({v}, default=0)", "return the largest (0 if none is left)", "int", "largest", lambda v: max(v, default=0)),
    ("min({v}, default=0)", "return the smallest (0 if none is left)", "int", "smallest", lambda v: min(v, default=0)),
    ("len({v})", "return how many there are", "int", "count", len),
    ("{v}", "return them as a list, in order", "list[int]", "select", list),
    ("sorted({v})", "return them in ascending order", "list[int]", "sort", sorted),
)


def _body(param: str, item: str, kept: str, test: str, value: str, loop: bool) -> list[str]:
    """The kept list built by a comprehension or a loop; `test` is empty when every item is kept."""
    if not loop:
        return [f"    {kept} = [{value} for {item} in {param}{f' if {test}' if test else ''}]"]
    lines = [f"    {kept} = []", f"    for {item} in {param}:"]
    if test:
        lines.append(f"        if {test}:")
    return [*lines, f"{'            ' if test else '        '}{kept}.append({value})"]


def composed(rng: random.Random) -> FunctionSpec:
    """A function contract drawn anew: `f(param)` keeps the items of `param` that pass a filter, maps them and
    reduces them; its example and its reference body (a loop or a comprehension) compute the same thing."""
    qualifier, noun = rng.choice(_QUALIFIERS), rng.choice(_NOUNS)
    param, item, kept = f"{qualifier}_{noun}", noun[:-1], f"{rng.choice(_KEPT)}_{noun}"
    keep = rng.choice(_FILTERS) if rng.random() < 0.8 else _KEEP_ALL
    change = rng.choice(_MAPS) if rng.random() < 0.6 else _SAME
    reduce, reduce_words, returns, verb, reduction = rng.choice(_REDUCES)
    kc, km = keep.draw(rng), change.draw(rng)
    steps = [f"Take the items of {{0}} {keep.words.format(k=kc)}".rstrip()]
    steps += [change.words.format(k=km)] if change.words else []
    doc = ", ".join(steps) + (", and " if len(steps) > 1 else " and ") + reduce_words + "."
    test, value = keep.code.format(x=item, k=kc), change.code.format(x=item, k=km)
    body = _body(param, item, kept, test, value, loop=rng.random() < 0.5)
    body.append(f"    return {reduce.format(v=kept)}")

    def example(r: random.Random) -> tuple[tuple, object]:
        items = [r.randint(-9, 30) for _ in range(r.randint(5, 8))]
        return (items,), reduction([change.run(x, km) for x in items if keep.run(x, kc)])

    name = f"{verb}_{param}" if keep is _KEEP_ALL else f"{verb}_{rng.choice(('kept', 'filtered', 'some'))}_{param}"
    return FunctionSpec((name,), ((param, "list[int]"),), returns, doc, example, "\n".join(body))
