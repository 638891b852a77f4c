"""Questions to the readers in plain English: several phrasings of each question the readers are trained on, and
of its negation, for measuring a response cache (bench/response_cache.py).

The readers speak only their one-token questions ("K?", "K=L?", "K1?"; bundled.reader.questions). A
:class:`Phrased` question pairs an English phrasing with the reader's form of what it asks, and whether it asks
the opposite (a negated "equal" question: "Do K and L hold different values?" is answered "y" where "K=L?" is
answered "n"). So the model's answer to a phrasing is the reader's answer to its form, flipped when negated: a
cache that serves a phrasing the answer to another question is caught whenever the two answers differ.
``OTHER_*_QUESTIONS`` are questions no reader answers, about the same panels and fields: any answer served to one
from a cache answers another question.
"""

from __future__ import annotations

from dataclasses import dataclass

from bundled.reader.questions import EQUAL, FIELD, NO, TWO_IMAGES, YES, Question

FIELD_PHRASINGS = (
    "What is the value of field {K}?",
    "What value does field {K} hold?",
    "Which value is shown in the {K} field?",
    "What does the field labelled {K} show?",
    "Read me the value of field {K}.",
    "Tell me what is written in field {K}.",
    "What's in field {K}?",
    "Field {K}: what value does it have?",
)
EQUAL_PHRASINGS = (
    "Do fields {K} and {L} hold the same value?",
    "Are the values of {K} and {L} the same?",
    "Is the value in {K} identical to the value in {L}?",
    "Do {K} and {L} match?",
    "Does field {K} show the same value as field {L}?",
    "Are {K} and {L} equal?",
)
# The same questions negated: their answers are the opposite.
NEGATED_EQUAL_PHRASINGS = (
    "Do fields {K} and {L} hold different values?",
    "Are the values of {K} and {L} not the same?",
    "Is the value in {K} different from the value in {L}?",
    "Do {K} and {L} differ?",
    "Does field {K} not show the same value as field {L}?",
    "Are {K} and {L} unequal?",
)
TWO_IMAGE_PHRASINGS = (
    "What is the value of field {K} in the {nth} panel?",
    "In the {nth} image, what does field {K} show?",
    "Which value does {K} hold in panel {n}?",
    "What does field {K} read in image {n}?",
    "Look at the {nth} panel: what is in field {K}?",
)
_NTH = {1: "first", 2: "second"}
# Other questions about the same panels and fields, which no reader answers (so none has a right answer here): a
# cached answer served to one is wrong whatever it says. They name the same fields as the questions above, so
# only the meaning tells them apart.
OTHER_FIELD_QUESTIONS = (
    "What kind of value does field {K} hold?",
    "Is the value of field {K} a colour?",
    "Which field is next to field {K}?",
    "Where on the panel is field {K}?",
    "How large is the text of field {K}?",
    "Is field {K} in the top row?",
)
OTHER_PAIR_QUESTIONS = (
    "Which of {K} and {L} is further left?",
    "Are {K} and {L} in the same row?",
    "Are fields {K} and {L} next to each other?",
    "Do {K} and {L} hold values of the same kind?",
    "Which comes first, {K} or {L}?",
)
OTHER_PANEL_QUESTIONS = (
    "How many fields does this panel show?",
    "Is this laid out as a table?",
    "What colour is the background?",
    "Which field is in the top left corner?",
    "Are there any words on this panel?",
    "What does this picture show?",
)


@dataclass(frozen=True)
class Phrased:
    text: str  # what a user asks
    question: Question  # the reader's form of it, over its panels
    negated: bool = False  # the text asks the opposite of the reader's question

    @property
    def answer(self) -> str:
        """The right answer to the text: the reader's question's, flipped when negated."""
        return flip(self.question.answer) if self.negated else self.question.answer

    def over(self, question: Question) -> Phrased:
        """The same phrasing of another reader question (the same question over other panels, say)."""
        return Phrased(self.text, question, self.negated)


def flip(answer: str) -> str:
    return {YES: NO, NO: YES}.get(answer, answer)


def phrasings(question: Question, *, negated: bool = False) -> tuple[Phrased, ...]:
    """Every phrasing of ``question`` (of its negation, for an equal question, when ``negated``)."""
    if question.kind == FIELD:
        if negated:
            raise ValueError("a field question has no negation with a one-token answer")
        return tuple(Phrased(t.format(K=question.text[0]), question) for t in FIELD_PHRASINGS)
    if question.kind == EQUAL:
        templates = NEGATED_EQUAL_PHRASINGS if negated else EQUAL_PHRASINGS
        return tuple(Phrased(t.format(K=question.text[0], L=question.text[2]), question, negated)
                     for t in templates)
    if question.kind == TWO_IMAGES:
        if negated:
            raise ValueError("a two-image question has no negation with a one-token answer")
        which = int(question.text[1])
        return tuple(Phrased(t.format(K=question.text[0], n=which, nth=_NTH[which]), question)
                     for t in TWO_IMAGE_PHRASINGS)
    raise ValueError(f"unknown question kind {question.kind!r}")
