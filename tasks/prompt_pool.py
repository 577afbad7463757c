"""Prompt selection for the first pipeline stage: which prompts the target model will answer.

The target's own replies to these prompts become the draft model's training data, so the pool must be
diverse (a draft trained on near-identical prompts learns one distribution) and short (the default target
is a 135M chat model running on CPU).
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Callable, Sequence
from fractions import Fraction

from pydantic import BaseModel, ConfigDict, Field, field_validator

from draftsmith.core.config.select import SYNTHETIC_CATEGORIES
from draftsmith.core.prompt_keys import dedupe_key
from draftsmith.tasks import prompt_pool_reuse

CATEGORIES = SYNTHETIC_CATEGORIES  # one list, in the recipe models

# Mirrors common chat datasets, where only a minority of conversations carry a system prompt.
_SYSTEM_RATE = 0.2
# Each category's template space is far larger than any realistic pool, so a handful of redraws
# almost always finds an unseen prompt; the cap only guards against pathological mixes.
_MAX_ATTEMPTS = 40


class PromptRecord(BaseModel):
    """One prompt (possibly multi-turn) for the target model to answer."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(min_length=1, description="Stable identifier, unique within a pool or file.")
    category: str = Field(min_length=1, description="Prompt family; splits are stratified on it.")
    system: str | None = Field(default=None, description="Optional system prompt sent before the first turn.")
    turns: list[str] = Field(
        min_length=1, description="User messages in order; the target generates one reply after each."
    )
    tools: list[dict] | None = Field(
        default=None, description="OpenAI-style tool definitions offered to the target in every turn."
    )

    @field_validator("id", "category")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must not be blank")
        return value

    @field_validator("system")
    @classmethod
    def _blank_system_is_none(cls, value: str | None) -> str | None:
        # An empty system prompt and no system prompt render differently in some chat templates;
        # collapsing them keeps dedupe keys and rendered prompts consistent.
        return value if value is not None and value.strip() else None

    @field_validator("turns")
    @classmethod
    def _turns_not_blank(cls, value: list[str]) -> list[str]:
        for index, turn in enumerate(value):
            if not turn.strip():
                raise ValueError(f"turn {index} is empty")
        return value


# --------------------------------------------------------------------------------------------------
# Vocabulary for the synthetic pool ("|" separates entries that contain spaces).

_SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a concise assistant. Keep answers short.",
    "You are a patient tutor who explains things step by step.",
    "You are a friendly assistant. Answer clearly and politely.",
    "You are a knowledgeable assistant. Be accurate and clear.",
    "Answer in plain language and avoid jargon.",
)
_MATH_SUFFIXES = ("", "", " Show your work.", " Explain step by step.", " Give only the final answer.")
_QA_SUFFIXES = (
    "",
    "",
    " Keep it brief.",
    " Answer in two or three sentences.",
    " Use an everyday example.",
    " Explain step by step.",
    " Answer for a curious teenager.",
)
_CODE_LANGS = ("Python", "Python", "Python", "Python", "JavaScript", "Go", "Rust", "Java", "C", "TypeScript")
_CODE_CONSTRAINTS = (
    "",
    "",
    " Use no imports.",
    " Add type hints.",
    " Include a docstring.",
    " Keep it under 10 lines.",
    " Handle empty input.",
    " Make it run in O(n) time.",
    " Add two example calls.",
    " Do not use recursion.",
    " Explain it briefly.",
)
_WHY_FORMS = (
    "Explain why {x}.",
    "Why is it that {x}?",
    "In simple terms, explain why {x}.",
    "Give two reasons why {x}.",
    "Explain to a {age}-year-old why {x}.",
    "What is the scientific or historical reason that {x}?",
)
_ORDER_TRAITS = (
    ("taller", "tallest", "shortest"),
    ("older", "oldest", "youngest"),
    ("faster", "fastest", "slowest"),
    ("richer", "richest", "poorest"),
)
_SYLLOGISMS = [
    tuple(chain.split())
    for chain in (
        "cats mammals animals|roses flowers plants|squares rectangles shapes|sparrows birds animals|"
        "violins instruments objects|oaks trees plants|trout fish animals|hammers tools objects"
    ).split("|")
]
_SUMMARY_STYLES = (
    "in one sentence",
    "in under 20 words",
    "for a ten-year-old",
    "as a headline",
    "as two bullet points",
)
_LENGTHS = (
    "",
    "in under 50 words",
    "in three sentences",
    "in four lines",
    "in one short paragraph",
    "in about 80 words",
)
_LANGS = ("French", "Spanish", "German", "Chinese", "Italian", "Portuguese", "Japanese")
# Prompts written natively (French, Spanish, German, Chinese, Italian, Portuguese, Japanese).
_NATIVE = (
    "Quelle est la capitale de l'Italie ?",
    "Peux-tu m'expliquer comment fonctionne la photosynthèse ?",
    "Donne-moi trois conseils pour mieux dormir.",
    "Écris un court poème sur la mer.",
    "¿Cuál es el río más largo del mundo?",
    "Explícame qué es la gravedad en pocas palabras.",
    "Dame tres ideas para una cena rápida.",
    "¿Por qué es importante beber agua?",
    "Was ist die Hauptstadt von Kanada?",
    "Erkläre mir kurz, wie ein Regenbogen entsteht.",
    "Nenne drei Vorteile vom Radfahren.",
    "Schreibe eine kurze Geschichte über einen Hund.",
    "中国的首都是哪里？",
    "请简单解释一下什么是人工智能。",
    "给我三个学习英语的建议。",
    "为什么海水是咸的？",
    "Qual è la montagna più alta d'Europa?",
    "Spiegami in breve cos'è il Rinascimento.",
    "Qual é o maior planeta do sistema solar?",
    "Explique de forma simples o que é a inflação.",
    "日本で一番高い山は何ですか？",
    "光合成について簡単に説明してください。",
)
_NAMES = (
    "Maria Ahmed Chen Priya Lucas Amara Kenji Sofia Omar Elena Tom Aisha Diego Hana Noah Fatima Leo "
    "Ines Ravi Zoe Mateo Yuki Sam Nadia Ivan Grace Kofi Lena Arjun Mia"
).split()
_ITEMS = (
    "apples pears notebooks pencils oranges cookies tickets stickers muffins candles bananas marbles "
    "batteries postcards cupcakes lemons erasers bagels"
).split()
_THINGS = "jacket|bicycle|laptop|pair of shoes|lamp|backpack|watch|guitar|tent|coffee maker".split("|")
_CODE_TASKS = (
    "reverses a string|checks whether a number is prime|counts the vowels in a string|returns the "
    "n-th Fibonacci number|merges two sorted lists|removes duplicates from a list while keeping "
    "order|finds the second largest number in a list|checks whether a string is a palindrome|"
    "converts Celsius to Fahrenheit|flattens a nested list|counts word frequencies in a text|"
    "computes the factorial of n|finds the longest common prefix of a list of strings|rotates a "
    "list by k positions|groups words that are anagrams|computes the median of a list|checks "
    "whether brackets in a string are balanced|converts a Roman numeral to an integer|splits a "
    "list into chunks of size n|finds all pairs in a list that sum to a target|capitalizes the "
    "first letter of every word|computes the greatest common divisor of two numbers|transposes a "
    "matrix|sums the digits of an integer|converts a decimal number to binary|counts the lines in "
    "a text file|finds the missing number in a list of 1 to n|checks whether two strings are "
    "anagrams|performs binary search on a sorted list|compresses a string with run-length "
    "encoding|returns the k most common elements of a list|validates a simple email address"
).split("|")
_CODE_CONCEPTS = (
    "a list and a tuple in Python|a process and a thread|a stack and a queue|an array and a "
    "linked list|pass by value and pass by reference|SQL and NoSQL databases|an interface and "
    "an abstract class|compiled and interpreted languages|git merge and git rebase|a shallow "
    "copy and a deep copy|TCP and UDP|synchronous and asynchronous code|unit tests and "
    "integration tests"
).split("|")
_WHY = (
    "the sky is blue|ice floats on water|leaves change color in autumn|we have seasons|bread rises|metal "
    "feels colder than wood|the Moon has phases|salt melts ice on roads|the Roman Empire declined|the "
    "printing press changed Europe|deserts get cold at night|onions make people cry|airplanes can fly|"
    "the ocean is salty|cats purr|people yawn|coffee keeps people awake|rainbows form after rain|the "
    "Industrial Revolution started in Britain|vaccines prevent disease|the Dead Sea is so salty|we see "
    "lightning before we hear thunder|sunsets are red|plants need sunlight|sleep is important for memory|"
    "prices rise during inflation|the Nile was important to ancient Egypt|hot air balloons rise|bicycles "
    "stay upright when moving|batteries lose charge over time|the Great Wall of China was built|"
    "volcanoes erupt|some animals hibernate|soap removes grease|stars twinkle"
).split("|")
_COUNTRIES = (
    "Australia Canada Brazil Japan Kenya Norway Egypt Peru Vietnam Morocco Chile Poland Thailand "
    "Argentina Ghana Portugal Mexico Turkey Iceland Indonesia Nigeria Greece Sweden India"
).split()
_PEOPLE = (
    "Marie Curie|Isaac Newton|Ada Lovelace|Leonardo da Vinci|Nelson Mandela|Cleopatra|Galileo Galilei|"
    "Alan Turing|Frida Kahlo|Mahatma Gandhi|Charles Darwin|Rosalind Franklin|Confucius|Genghis Khan|"
    "Wolfgang Amadeus Mozart|Ibn Battuta|Nikola Tesla|Harriet Tubman"
).split("|")
_HOW_THINGS = (
    "a refrigerator|a rainbow|the internet|a vaccine|a compass|a solar panel|a microwave oven|a "
    "credit card|an elevator|a bicycle gear|GPS|a thermometer|a heat pump|a lock and key|"
    "photosynthesis|a search engine|a hydroelectric dam|the human heart"
).split("|")
_PAIRS = (
    "weather and climate|a virus and a bacterium|speed and velocity|an island and a peninsula|a "
    "democracy and a monarchy|a comet and an asteroid|mass and weight|a lake and a sea|an epidemic and "
    "a pandemic|baking soda and baking powder|a crocodile and an alligator|a hurricane and a tornado|a "
    "fruit and a vegetable|a republic and an empire"
).split("|")
_FORMS = (
    "short story|poem|haiku|limerick|diary entry|product description|fable|song chorus|short speech|"
    "news report|bedtime story|motivational note"
).split("|")
_SUBJECTS = (
    "a lighthouse keeper|a lost umbrella|the first day of spring|a robot learning to cook|a city at "
    "midnight|an old bookstore|a dragon who is afraid of fire|moving to a new town|a rainy Monday|a "
    "friendship between a cat and a crow|the ocean|a forgotten birthday|a train journey|a garden in "
    "winter|a child's first bicycle|a detective who loses her glasses|coffee|the last day of school|"
    "a mountain village|a time traveler at a market|a broken clock|learning a new language|a street "
    "musician|the Moon|a camping trip that goes wrong|an astronaut missing home"
).split("|")
_TONES = "cheerful melancholy humorous formal mysterious hopeful playful calm dramatic nostalgic".split()
_RECIPIENTS = "your manager|your landlord|a customer|a teacher|a neighbor|a colleague|a hotel".split("|")
_PURPOSES = (
    "asking for a day off|about a broken heater|apologizing for a late delivery|requesting a "
    "meeting next week|thanking them for their help|declining an invitation|asking for a refund|"
    "following up on a job application|reporting a noisy party|confirming a reservation"
).split("|")
_FACTS = (
    "Honeybees communicate the location of flowers through a waggle dance.|The Amazon rainforest "
    "produces a large share of the world's oxygen.|Regular walking lowers the risk of heart disease.|"
    "The first printed newspapers appeared in Europe in the 17th century.|Solar power has become much "
    "cheaper over the last decade.|Octopuses have three hearts and blue blood.|Many cities are "
    "planting trees to reduce summer heat.|Sleep helps the brain store new memories.|The Sahara was "
    "once green and full of lakes.|Recycling aluminum uses far less energy than making new metal.|"
    "Children learn languages faster when they hear them every day.|Remote work has changed how "
    "offices are designed.|Coral reefs are threatened by warming oceans.|The Silk Road connected China "
    "with the Mediterranean.|Electric cars have fewer moving parts than petrol cars."
).split("|")
_PHRASES = (
    "good morning|where is the train station|thank you very much|I am learning to cook|the weather "
    "is nice today|how much does this cost|I would like a cup of tea|see you tomorrow|my brother "
    "lives in a small town|can you help me|I love reading books|happy birthday"
).split("|")
_FOLLOW_UPS = (
    "Can you make it shorter?|Now give an example.|Can you explain that more simply?|Why is that?|"
    "Can you put that in a bulleted list?|What is a common mistake people make here?|Now "
    "summarize it in one sentence.|Can you make it more formal?|How would you explain this to a "
    "child?|Give me another example.|What are the limitations of that?|Thanks! Can you add a "
    "short title?|Now rewrite it for a complete beginner.|Can you say that in a different way?|"
    "What should I read next to learn more?"
).split("|")
_CITIES = "Lisbon|Kyoto|Mexico City|Cape Town|Istanbul|Vancouver|Hanoi|Prague|Buenos Aires".split("|")
_HOBBIES = (
    "running|painting|gardening|chess|playing the guitar|photography|baking bread|learning to code|"
    "yoga|birdwatching|knitting|rock climbing"
).split("|")
_INGREDIENTS = "eggs|rice|spinach|tomatoes|chickpeas|potatoes|cheese|onions|pasta|tofu|lentils".split("|")


# --------------------------------------------------------------------------------------------------
# Generators: each returns the user turns of one prompt.


def _math(rng: random.Random) -> list[str]:
    name, other = rng.sample(_NAMES, 2)
    item_a, item_b = rng.sample(_ITEMS, 2)
    n1, n2, p1, p2 = (rng.randint(2, 12) for _ in range(4))
    pct, den = rng.choice((5, 10, 15, 20, 25, 30, 40, 50, 75)), rng.choice((2, 3, 4, 5, 6, 8))
    num, speed, hours = rng.randint(1, den - 1), rng.randint(30, 120), rng.randint(2, 9)
    age, gap, later = rng.randint(5, 40), rng.randint(2, 15), rng.randint(2, 20)
    money, price = rng.randint(20, 200), rng.randint(20, 400)
    options = (
        f"{name} buys {n1} {item_a} at ${p1} each and {n2} {item_b} at ${p2} each. "
        f"How much does {name} spend in total?",
        f"A train travels at {speed} km/h for {hours} hours. How far does it go?",
        f"{name} cycles {speed // 5} km in {hours} hours. What is the average speed in km/h?",
        f"{name} is {age} years old and {other} is {gap} years older. How old will {other} be in {later} years?",
        f"A {rng.choice(_THINGS)} costs ${price} and is on sale for {pct}% off. What is the sale price?",
        f"What is {pct}% of {price * 2}? Explain how you got it.",
        f"{name} has {den * n1} {item_a} and gives {num}/{den} of them to {other}. How many are left?",
        f"Add the fractions {num}/{den} and {rng.randint(1, 5)}/{rng.choice((3, 7, 9, 10))} and simplify.",
        f"{name} has ${money}, spends ${money // n1} on {item_a}, then earns ${p1 * n2}. How much now?",
        f"If {n1} workers paint a fence in {hours} hours, how long would {n1 + n2} workers take?",
        f"A rectangle is {n1} cm wide and {n2 + n1} cm long. What are its area and perimeter?",
        f"Solve for x: {n1}x + {p1} = {n1 * later + p1}.",
        f"{name}'s test scores are {age + 50}, {later + 70} and {speed % 30 + 65}. What is the average?",
        f"A recipe needs {n1} eggs for {n2} people. How many eggs are needed for {n2 * 3} people?",
    )
    return [rng.choice(options) + rng.choice(_MATH_SUFFIXES)]


def _coding(rng: random.Random) -> list[str]:
    lang, task = rng.choice(_CODE_LANGS), rng.choice(_CODE_TASKS)
    options = (
        f"Write a {lang} function that {task}.{rng.choice(_CODE_CONSTRAINTS)}",
        f"Write a {lang} function that {task}.{rng.choice(_CODE_CONSTRAINTS)}",
        f"How would you write a {lang} function that {task}?{rng.choice(_CODE_CONSTRAINTS)}",
        f"Write unit tests for a {lang} function that {task}.",
        f"What edge cases should a {lang} function that {task} handle?{rng.choice(_QA_SUFFIXES)}",
        f"What is the time complexity of a {lang} function that {task}?{rng.choice(_QA_SUFFIXES)}",
        f"Explain the difference between {rng.choice(_CODE_CONCEPTS)}, with a short {lang} example.",
    )
    return [rng.choice(options)]


def _reasoning(rng: random.Random) -> list[str]:
    a, b, c = rng.sample(_NAMES, 3)
    trait, most, least = rng.choice(_ORDER_TRAITS)
    sub, mid, sup = rng.choice(_SYLLOGISMS)
    # Asking the converse ("are all animals cats?") tests that the model does not just pattern-match "yes".
    first, second = rng.sample((sub, sup), 2)
    start, step = rng.randint(1, 20), rng.randint(2, 9)
    country = rng.choice(_COUNTRIES)
    options = (
        rng.choice(_WHY_FORMS).format(x=rng.choice(_WHY), age=rng.randint(6, 12)),
        rng.choice(_WHY_FORMS).format(x=rng.choice(_WHY), age=rng.randint(6, 12)),
        f"What is the capital of {country}, and what is it known for?{rng.choice(_QA_SUFFIXES)}",
        f"Name {rng.choice(('two', 'three', 'four'))} interesting facts about the geography of {country}.",
        f"What is {rng.choice(_PEOPLE)} best known for?{rng.choice(_QA_SUFFIXES)}",
        f"How does {rng.choice(_HOW_THINGS)} work?{rng.choice(_QA_SUFFIXES)}",
        f"What is the difference between {rng.choice(_PAIRS)}?{rng.choice(_QA_SUFFIXES)}",
        f"{a} is {trait} than {b}, and {b} is {trait} than {c}. Who is the {rng.choice((most, least))}?",
        f"All {sub} are {mid} and all {mid} are {sup}. Are all {first} {second}? Explain your reasoning.",
        f"What comes next in the sequence {', '.join(str(start + step * i) for i in range(4))}, ...? Why?",
        f"What comes next in the sequence {', '.join(str(start * step**i) for i in range(4))}, ...? Why?",
    )
    return [rng.choice(options)]


def _writing(rng: random.Random) -> list[str]:
    length, tone = rng.choice(_LENGTHS), rng.choice(_TONES)
    options = (
        f"Write a {tone} {rng.choice(_FORMS)} about {rng.choice(_SUBJECTS)} {length}".rstrip() + ".",
        f"Write a {rng.choice(_FORMS)} about {rng.choice(_SUBJECTS)} {length}".rstrip() + ".",
        f"Write a {tone} email to {rng.choice(_RECIPIENTS)} {rng.choice(_PURPOSES)}.",
        f"Summarize {rng.choice(_SUMMARY_STYLES)}: {' '.join(rng.sample(_FACTS, 2))}",
        f"Rewrite this text in a {tone} tone {length}".rstrip() + f": {rng.choice(_FACTS)}",
        f"Give me three creative titles for a {rng.choice(_FORMS)} about {rng.choice(_SUBJECTS)}.",
    )
    return [rng.choice(options)]


def _multilingual(rng: random.Random) -> list[str]:
    lang, native = rng.choice(_LANGS), rng.choice(_NATIVE)
    options = (
        f'Translate into {lang}: "{rng.choice(_FACTS)}"',
        f'How do you say "{rng.choice(_PHRASES)}" in {lang}?',
        f"Answer in {lang}: {_reasoning(rng)[0]}",
        f"Answer in {lang}: {_math(rng)[0]}",
        f"Write one sentence in {lang} about {rng.choice(_SUBJECTS)}, then translate it into English.",
        f"Respond only in {lang}. {_writing(rng)[0]}",
        f'Translate into {rng.choice((lang, "English"))}: "{native}"',
        native,
    )
    return [rng.choice(options)]


def _dialogue(rng: random.Random) -> list[str]:
    days, food = rng.randint(2, 7), " and ".join(rng.sample(_INGREDIENTS, 2))
    opener = rng.choice(
        (
            _math(rng)[0],
            _coding(rng)[0],
            _reasoning(rng)[0],
            _writing(rng)[0],
            f"I'm planning a {days}-day trip to {rng.choice(_CITIES)}. What should I not miss?",
            f"I want to start {rng.choice(_HOBBIES)}. Where should I begin?",
            f"I only have {food} at home. What can I cook for dinner?",
        )
    )
    # Follow-ups only make sense relative to the opener, which is what exercises multi-turn context.
    return [opener, *rng.sample(_FOLLOW_UPS, rng.randint(1, 2))]


_GENERATORS: dict[str, Callable[[random.Random], list[str]]] = {
    "math": _math,
    "coding": _coding,
    "reasoning": _reasoning,
    "writing": _writing,
    "multilingual": _multilingual,
    "dialogue": _dialogue,
    **prompt_pool_reuse.GENERATORS,
}
assert tuple(_GENERATORS) == CATEGORIES, "one generator per synthetic category, in the config's order"


# --------------------------------------------------------------------------------------------------
# Synthetic pool.


def _resolve_mix(mix: dict[str, float] | None) -> dict[str, Fraction]:
    if mix is None:
        return {c: Fraction(1) for c in CATEGORIES}
    for key, weight in mix.items():
        if key not in CATEGORIES:
            raise ValueError(f"unknown category {key!r} in mix; known: {', '.join(CATEGORIES)}")
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight):
            raise ValueError(f"mix weight for {key!r} must be a finite number, got {weight!r}")
        if weight < 0:
            raise ValueError(f"mix weight for {key!r} must be >= 0, got {weight!r}")
    if not any(w > 0 for w in mix.values()):
        raise ValueError("mix weights must not all be zero")
    return {c: Fraction(mix.get(c, 0)) for c in CATEGORIES}


def allocate(total: int, weights: dict[str, Fraction], order: Sequence[str] | None = None) -> dict[str, int]:
    """Largest-remainder split of `total` over `weights`; ties go to the first in `order` (default: sorted).

    Exact fractions: float quotas can floor 29.999... to 29 and hand a seat to a zero-weight category.
    """
    weight_sum = sum(weights.values())
    if total <= 0 or weight_sum <= 0:
        return dict.fromkeys(weights, 0)
    rank = {c: i for i, c in enumerate(order if order is not None else sorted(weights))}
    quotas = {c: total * w / weight_sum for c, w in weights.items()}
    counts = {c: math.floor(q) for c, q in quotas.items()}
    by_remainder = sorted(weights, key=lambda c: (counts[c] - quotas[c], rank[c]))
    for category in by_remainder[: total - sum(counts.values())]:
        counts[category] += 1
    return counts


def synthetic_pool(num_prompts: int, *, seed: int, mix: dict[str, float] | None = None) -> list[PromptRecord]:
    """Builds a deterministic, diverse pool of synthetic prompts.

    Args:
        num_prompts: Number of records to return (>= 0).
        seed: Seed for a private ``random.Random``; equal arguments give equal lists.
        mix: Target proportions per category (missing categories get 0). Defaults to equal weights.

    Returns:
        Records whose per-category counts follow ``mix`` by largest remainder, shuffled
        deterministically, with ids ``syn-{category}-{sha1 of the normalized text}``.

    Raises:
        ValueError: On a negative count, an unknown category in ``mix`` or invalid weights.
    """
    if num_prompts < 0:
        raise ValueError(f"num_prompts must be >= 0, got {num_prompts}")
    counts = allocate(num_prompts, _resolve_mix(mix), order=CATEGORIES)
    rng = random.Random(seed)
    seen: dict[str, int] = {}
    records = [_draw(category, rng, seen) for category in CATEGORIES for _ in range(counts[category])]
    rng.shuffle(records)
    return records


def _draw(category: str, rng: random.Random, seen: dict[str, int]) -> PromptRecord:
    for _ in range(_MAX_ATTEMPTS):
        turns = _GENERATORS[category](rng)
        system = rng.choice(_SYSTEM_PROMPTS) if rng.random() < _SYSTEM_RATE else None
        key = dedupe_key(system, turns)
        if key not in seen:
            break
    repeats = seen[key] = seen.get(key, 0) + 1
    record_id = f"syn-{category}-{hashlib.sha1(key.encode('utf-8')).hexdigest()[:12]}"
    # Only when redraws ran out: the text repeats, but ids must stay unique.
    if repeats > 1:
        record_id += f"-{repeats - 1}"
    return PromptRecord(id=record_id, category=category, system=system, turns=turns)
