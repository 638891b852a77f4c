"""The guard: vetoes a paraphrase or similar hit whose question differs from the cached one where sentence
embeddings are known to look past a difference that changes the answer.

Measured with the embedder the cache uses (all-MiniLM-L6-v2): "Do K and L hold the same value?" and "Do K and L
hold different values?" have a cosine of 0.98; "... in the first panel?" and "... in the second panel?" 0.98;
"What is the value of field K?" and "... field M?" 0.76, as close as a true paraphrase ("What does field K show?",
0.77). So a hit needs both questions to agree on:

    negation   the negating words they hold (not, no, never, without, except, n't, ...), as a count
    numbers    the numbers they name, in digits or words (one .. twenty, first .. tenth, hundred, ...)
    entities   the names they use: words capitalised inside a sentence, all-capital words and single capital
               letters (a field "K", "USA"), words with digits ("v2", "B12"), quoted text; compared with case
    contrast   the words that set a question's polarity, by class: same / different, more / less, before / after,
               above / below, left / right, top / bottom, start / end, true / false, max / min, inside / outside,
               open / closed, increase / decrease, all / some; so "identical" for "same" passes, "different" does
               not. Words too common to set polarity on their own (in, on, up, over, any, only) are left out
    asking     the question words beyond what / which (where, when, who, why, how): what the answer is to be
    aspect     the attribute asked about, by class: kind (type, sort), colour, size, position (row, next to),
               count (how many), name (label), style (font, layout); "What kind of value does field K hold?" is
               not "What value does field K hold?" (cosine 0.93)

A veto costs a hit (the question runs on the model), never an answer: the guard errs on that side. It reads only
the two questions' texts (their last user turns); everything else in a request must already be equal.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from dataclasses import dataclass

NEGATION, NUMBER, ENTITY, CONTRAST, ASKING, ASPECT = "negation", "number", "entity", "contrast", "asking", "aspect"
VETOES = (NEGATION, NUMBER, ENTITY, CONTRAST, ASKING, ASPECT)

_NEGATIONS = frozenset({"not", "no", "never", "none", "nothing", "nobody", "nowhere", "neither", "nor", "without",
                        "except", "cannot", "unless", "lack", "lacks", "lacking", "absent", "missing"})
_NUMBER_WORDS = {word: str(value) for value, word in enumerate(
    ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
     "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty"))}
_NUMBER_WORDS.update({"thirty": "30", "forty": "40", "fifty": "50", "sixty": "60", "seventy": "70", "eighty": "80",
                      "ninety": "90", "hundred": "100", "thousand": "1000", "million": "1000000",
                      "billion": "1000000000", "dozen": "12", "half": "0.5", "once": "1", "twice": "2",
                      "single": "1", "double": "2", "triple": "3", "pair": "2", "both": "2"})
_ORDINALS = {word: str(value) for value, word in enumerate(
    ("zeroth", "first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth"))}
# Classes of words that set a question's polarity; questions must name the same classes. Grouped by meaning, so
# synonyms pass. A word may be in more than one ("right": a side, and correct).
_CONTRAST_CLASSES = {
    "same": ("same", "identical", "equal", "equals", "alike", "match", "matches", "matching", "equivalent"),
    "different": ("different", "differ", "differs", "difference", "unequal", "distinct", "mismatch", "unlike",
                  "another"),
    "more": ("more", "most", "greater", "greatest", "larger", "largest", "bigger", "biggest", "higher", "highest",
             "above", "exceed", "exceeds", "maximum", "max", "longer", "longest"),
    "less": ("less", "least", "fewer", "fewest", "smaller", "smallest", "lower", "lowest", "below",
             "minimum", "min", "shorter", "shortest"),
    "before": ("before", "earlier", "previous", "prior", "preceding", "former", "last"),
    "after": ("after", "later", "next", "following", "latter", "subsequent"),
    "left": ("left", "leftmost", "west"),
    "right": ("right", "rightmost", "east"),
    "top": ("top", "upper", "north", "topmost"),
    "bottom": ("bottom", "lower", "south", "bottommost"),
    "start": ("start", "begin", "beginning", "initial"),
    "end": ("end", "final", "finish", "ending"),
    "true": ("true", "correct", "right", "yes", "valid", "allowed"),
    "false": ("false", "wrong", "incorrect", "invalid", "denied", "forbidden"),
    "in": ("inside", "within", "included", "include", "includes"),
    "out": ("outside", "excluded", "exclude", "excludes"),
    "open": ("open", "opened", "enabled", "enable", "active", "checked", "selected", "visible"),
    "closed": ("closed", "close", "disabled", "disable", "inactive", "unchecked", "unselected", "hidden"),
    "increase": ("increase", "increased", "increases", "rise", "rose", "grow", "grew", "gain"),
    "decrease": ("decrease", "decreased", "decreases", "fall", "fell", "drop", "dropped", "shrink", "loss"),
    "all": ("all", "every", "always"),
    "some": ("some", "sometimes", "partly"),
}
_CONTRAST: dict[str, frozenset[str]] = {}
for _group, _words in _CONTRAST_CLASSES.items():
    for _word in _words:
        _CONTRAST[_word] = _CONTRAST.get(_word, frozenset()) | {_group}

# Question words, by what they ask for. "what" and "which" ask alike (and a request may ask without one: "Read me
# field K"); any other that one question has and the other lacks asks for something else.
_ASKING = {"what": "what", "which": "what", "where": "where", "when": "when", "who": "who", "whom": "who",
           "whose": "who", "why": "why", "how": "how"}
# Words naming the attribute a question is about, by attribute: asking a field's kind of value, its colour or its
# size is not asking its value, though "What kind of value does field K hold?" and "What value does field K hold?"
# have a cosine of 0.93. Synonyms share a class.
_ASPECT_CLASSES = {
    "kind": ("kind", "kinds", "type", "types", "sort", "sorts", "category", "categories", "class", "format"),
    "colour": ("colour", "colours", "color", "colors", "coloured", "colored", "hue", "tint"),
    "size": ("size", "sizes", "large", "small", "big", "tall", "wide", "long", "height", "width", "length"),
    "position": ("position", "place", "location", "located", "row", "rows", "column", "columns", "corner", "side",
                 "next", "beside", "adjacent", "near", "neighbour", "neighbor", "further", "far"),
    "count": ("many", "much", "count", "counts", "number", "total", "amount"),
    "name": ("name", "label", "title"),  # not "labelled", "named": they say which field, not what is asked
    "style": ("font", "style", "bold", "italic", "layout", "laid", "background", "border"),
}
_ASPECT = {word: group for group, words in _ASPECT_CLASSES.items() for word in words}

_SENTENCE_END = re.compile(r"[.!?]+\s+|\n+")
_QUOTED = re.compile(r"\"([^\"]{1,200})\"|'([^']{1,200})'|“([^”]{1,200})”|`([^`]{1,200})`")
_WORD = re.compile(r"[^\W_]+(?:['’][^\W_]+)*", re.UNICODE)
_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")


@dataclass(frozen=True, slots=True)
class Salient:
    """What the guard compares in one question."""

    negations: int
    numbers: Counter[str]
    entities: Counter[str]
    contrast: frozenset[str]
    asking: frozenset[str]  # question words other than what / which
    aspects: frozenset[str]

    @classmethod
    def of(cls, text: str) -> Salient:
        text = unicodedata.normalize("NFKC", text)
        negations = 0
        numbers: Counter[str] = Counter()
        entities: Counter[str] = Counter(next(g for g in m.groups() if g is not None) for m in _QUOTED.finditer(text))
        contrast: set[str] = set()
        asking: set[str] = set()
        aspects: set[str] = set()
        for sentence in _SENTENCE_END.split(text):
            for position, word in enumerate(_WORD.findall(sentence)):
                lower = word.lower()
                if lower.endswith(("n't", "n’t")):
                    negations += 1
                    lower = lower[:-3]
                if lower in _NEGATIONS:
                    negations += 1
                if _NUMBER.fullmatch(word):
                    numbers[word.replace(",", "")] += 1
                    continue
                if (number := _NUMBER_WORDS.get(lower) or _ORDINALS.get(lower)) is not None:
                    numbers[number] += 1
                elif any(ch.isdigit() for ch in word):
                    numbers.update(_NUMBER.findall(word))
                    entities[word] += 1
                    continue
                contrast.update(_CONTRAST.get(lower, ()))
                if (kind := _ASKING.get(lower)) is not None and kind != "what":
                    asking.add(kind)
                if (aspect := _ASPECT.get(lower)) is not None:
                    aspects.add(aspect)
                if _is_entity(word, position):
                    entities[word] += 1
        return cls(negations=negations, numbers=numbers, entities=entities, contrast=frozenset(contrast),
                   asking=frozenset(asking), aspects=frozenset(aspects))


def _is_entity(word: str, position: int) -> bool:
    if word.isupper():  # "K", "USA"; but "I", and "A" opening a sentence, are ordinary words
        return not (word == "I" or (word == "A" and position == 0))
    if any(ch.isupper() for ch in word[1:]):  # camelCase, McDonald
        return True
    return word[0].isupper() and position > 0  # capitalised inside a sentence


def veto(question: str, cached: str) -> str | None:
    """Why a hit of ``question`` on the cached question ``cached`` must not be served (one of VETOES), or None."""
    return veto_salient(Salient.of(question), Salient.of(cached))


def veto_salient(question: Salient, cached: Salient) -> str | None:
    return next((reason for reason, part in _COMPARED if getattr(question, part) != getattr(cached, part)), None)


_COMPARED = ((NEGATION, "negations"), (NUMBER, "numbers"), (ENTITY, "entities"), (CONTRAST, "contrast"),
             (ASKING, "asking"), (ASPECT, "aspects"))  # in VETOES' order: the first difference names the veto
