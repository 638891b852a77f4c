"""How the readers' questions become model inputs and training targets: the prompt in the bundled chat template,
the panels drawn at their placements, the answer and hop positions, and what each image token is taught to say
(the auxiliary classes). Used by training (bundled.reader.train) and by the evaluations that ask the readers."""

from __future__ import annotations

import torch

from bundled.reader.panels import KEYS, VALUES, Panel, Placement
from bundled.reader.questions import Question

EMPTY = "-"  # the auxiliary class of an image token that shows no field


class Batcher:
    """Turns questions into model inputs with the bundled processor and chat template."""

    def __init__(self, processor) -> None:
        self.processor = processor
        tokenizer = processor.tokenizer
        tokenizer.padding_side = "right"
        self.value_ids = value_token_ids(tokenizer)
        self.im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.vision_end = tokenizer.convert_tokens_to_ids("<|vision_end|>")

    def prompt(self, question: Question) -> str:
        content: list[dict] = [{"type": "image"} for _ in question.panels]
        messages = [{"role": "user", "content": [*content, {"type": "text", "text": question.text}]}]
        return self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def __call__(self, questions: list[Question], with_answers: bool = True,
                 placements: list[Placement] | None = None) -> dict:
        """Model inputs for ``questions``, each question's panels drawn at its placement (default: as drawn)."""
        placements = placements or [Placement()] * len(questions)
        shown = [(panel, placement) for q, placement in zip(questions, placements, strict=True) for panel in q.panels]
        texts = [self.prompt(q) + (q.answer + "<|im_end|>" if with_answers else "") for q in questions]
        images = [placement.render(panel) for panel, placement in shown]
        inputs = self.processor(text=texts, images=images, padding=True, return_tensors="pt")
        lengths = inputs["attention_mask"].sum(1)
        answers = torch.tensor([self.value_ids[q.answer] for q in questions])
        offset = 2 if with_answers else 0
        # The position whose logits predict the answer: the last prompt token.
        inputs["answer_at"] = lengths - 1 - offset
        # The question's first token, right after the last image.
        ids = inputs["input_ids"]
        question_at = ((ids == self.vision_end) * torch.arange(ids.shape[1])).argmax(1) + 1
        hops = [(row, int(question_at[row]) + at, self.value_ids[value])
                for row, q in enumerate(questions) for at, value in q.hops]
        inputs["hop_rows"], inputs["hop_at"], inputs["hop_values"] = torch.tensor(hops).T
        inputs["answers"] = answers
        if with_answers:
            labels = torch.full_like(ids, -100)
            rows = torch.arange(len(questions))
            labels[rows, lengths - 2] = answers
            labels[rows, lengths - 1] = self.im_end
            inputs["labels"] = labels
        inputs["token_keys"], inputs["token_values"] = token_targets(shown)
        inputs["token_left"], inputs["token_above"] = neighbour_targets(shown)
        return inputs


def reading_targets(panel: Panel, placement: Placement) -> tuple[dict[int, str], dict[int, str]]:
    """What each image token of ``panel`` drawn at ``placement`` is taught to say (the auxiliary loss): the token
    holding a field's key glyph says that key and the field's value, wherever the value's glyph fell; a token holding
    a value's glyph and no key says that value. As drawn, a field's first token holds both glyphs, so this is where
    they are; moved, a key and its value may fall in neighbouring tokens (8 to 20 px right of the grid, a key's token
    holds the previous field's value), and a token that said what it holds would pair a key with another field's
    value: the vision tower is taught to carry the value to its key, and the language model reads a moved panel as
    it reads an aligned one."""
    key_at, value_at = placement.token_labels(panel)
    values = dict(value_at)
    for token, key in key_at.items():
        values[token] = panel.value(key)
    return key_at, values


def token_targets(shown: list[tuple[Panel, Placement]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The auxiliary classes (KEY_CLASSES, VALUE_CLASSES) of every image token of ``shown``, in order."""
    keys, values = [], []
    for panel, placement in shown:
        key_at, value_at = reading_targets(panel, placement)
        grid_rows, grid_cols = placement.grid(panel)
        for token in range(grid_rows * grid_cols):
            keys.append(KEY_CLASSES.index(key_at.get(token, EMPTY)))
            values.append(VALUE_CLASSES.index(value_at.get(token, EMPTY)))
    return torch.tensor(keys), torch.tensor(values)


def neighbour_targets(shown: list[tuple[Panel, Placement]]) -> tuple[torch.Tensor, torch.Tensor]:
    """What each image token of ``shown`` is taught to have noted (the deep reader's notes loss): the value of the
    field covering the cell to its left, and the one above (VALUE_CLASSES; EMPTY where none). Panels as drawn only:
    moved, a token's neighbours are not fields' cells, and every class is EMPTY."""
    left, above = [], []
    for panel, placement in shown:
        grid_rows, grid_cols = placement.grid(panel)
        value_at = {}
        if placement == Placement():
            for key in panel.keys:
                for cell in panel.cells_of(key):
                    value_at[cell] = panel.value(key)
        for token in range(grid_rows * grid_cols):
            row, col = divmod(token, grid_cols)
            left.append(VALUE_CLASSES.index(value_at.get((row, col - 1), EMPTY)))
            above.append(VALUE_CLASSES.index(value_at.get((row - 1, col), EMPTY)))
    return torch.tensor(left), torch.tensor(above)


KEY_CLASSES = (EMPTY, *KEYS)
VALUE_CLASSES = (EMPTY, *VALUES)


def value_token_ids(tokenizer) -> dict[str, int]:
    """Every answer's token id (each answer is one token)."""
    return {value: single_token(tokenizer, value) for value in VALUES}


def single_token(tokenizer, text: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"answer {text!r} is {len(ids)} tokens in the bundled tokenizer; answers must be one")
    return ids[0]
