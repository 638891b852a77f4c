"""Deterministic training text for the bundled tokenizer.

The text is generated from fixed word lists with a seeded ``random.Random``, so every machine
produces the same bytes without reading anything from disk or the network. It is shaped like the
prompts the gateway serves: questions and descriptions about pictures, screenshots and documents,
plus numbers, punctuation and a little code so that every kind of input splits into few tokens.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

CORPUS_SEED = 20240917

_NOUNS = (
    "image picture photo screenshot page document window button menu dialog table chart graph "
    "figure diagram map label caption title heading paragraph line word letter number digit "
    "cell row column grid icon logo text field box panel tab toolbar sidebar header footer "
    "person man woman child face hand eye hair shirt hat cat dog bird horse car bus train bike "
    "road street house building door wall roof tree flower grass sky cloud sun moon water sea "
    "river mountain hill field city room kitchen table chair desk lamp book cup plate bottle "
    "phone screen keyboard mouse computer camera clock watch sign arrow circle square triangle "
    "shape color object item scene background foreground corner edge center top bottom side "
    "astronaut coffee rocket suit flag helmet glove moonlight galaxy planet star space station "
    "file folder path link url name value result error warning message list item option"
).split()

_ADJECTIVES = (
    "red green blue yellow orange purple pink brown black white gray dark light bright pale "
    "large small big tiny little huge wide narrow tall short long round square flat thin thick "
    "old new young modern open closed empty full first second third last next previous left "
    "right upper lower middle main visible hidden bold italic blurry sharp clear noisy simple "
    "complex striped spotted wooden metal glass plastic paper digital printed handwritten"
).split()

_VERBS = (
    "shows contains holds displays lists describes reads says points covers fills surrounds "
    "opens closes starts ends moves sits stands runs walks looks faces wears carries uses "
    "appears remains follows precedes matches differs repeats highlights marks selects"
).split()

_PREPOSITIONS = "in on at under over behind beside near above below inside outside between".split()

_QUESTIONS = (
    "What is in the {noun}?",
    "What color is the {noun}?",
    "How many {noun}s are there in the {noun2}?",
    "Where is the {adj} {noun}?",
    "Describe the {noun} {prep} the {noun2}.",
    "Read the text on the {adj} {noun}.",
    "Is there a {noun} {prep} the {noun2}?",
    "Which {noun} is {adj}er than the {noun2}?",
    "What does the {noun} in row {n} column {m} say?",
    "Summarise this {noun} in {n} words.",
)

_STATEMENTS = (
    "The {adj} {noun} {verb} a {adj2} {noun2}.",
    "A {noun} {verb} the {noun2} {prep} the {adj} {noun3}.",
    "There are {n} {noun}s {prep} the {noun2}.",
    "In the {adj} {noun}, the {noun2} {verb} {n} {noun3}s.",
    "The {noun} at ({n}, {m}) is {adj}.",
    "Click the {adj} {noun} to open the {noun2}.",
    "Row {n}, column {m}: {adj} {noun}.",
    "{Noun} {n} of {m}: the {noun2} {verb} {prep} the {noun3}.",
)

_CODE = (
    "def {noun}_{noun2}(x):\n    return x + {n}\n",
    "for i in range({n}):\n    print(i, '{noun}')\n",
    '{{"{noun}": {n}, "{noun2}": "{adj}"}}\n',
    "if {noun} is None:\n    raise ValueError('{adj} {noun2}')\n",
    "<div class=\"{noun}\">{adj} {noun2}</div>\n",
    "| {noun} | {n} | {adj} |\n",
)


def _fill(template: str, rng: random.Random) -> str:
    noun = rng.choice(_NOUNS)
    return template.format(
        noun=noun,
        Noun=noun.capitalize(),
        noun2=rng.choice(_NOUNS),
        noun3=rng.choice(_NOUNS),
        adj=rng.choice(_ADJECTIVES),
        adj2=rng.choice(_ADJECTIVES),
        verb=rng.choice(_VERBS),
        prep=rng.choice(_PREPOSITIONS),
        n=rng.randrange(0, 1000),
        m=rng.randrange(0, 100),
    )


def corpus_lines(n_paragraphs: int = 20_000, seed: int = CORPUS_SEED) -> Iterator[str]:
    """Yield ``n_paragraphs`` paragraphs of training text; the same arguments give the same text."""
    rng = random.Random(seed)
    for _ in range(n_paragraphs):
        kind = rng.random()
        if kind < 0.1:
            yield _fill(rng.choice(_CODE), rng)
            continue
        parts = [
            _fill(rng.choice(_QUESTIONS if rng.random() < 0.4 else _STATEMENTS), rng)
            for _ in range(rng.randrange(1, 5))
        ]
        yield " ".join(parts) + "\n"
