"""Train a reader from scratch on CPU: ``python -m bundled.reader.train --size reader|oracle``.

The model is the bundled ``qwen2_5_vl`` / ``reader`` or ``oracle`` recipe (transformers' Qwen2.5-VL classes, the
bundled tokenizer and processor), starting from the recipe's deterministic random weights. Each example is a
question over generated panels (bundled.reader.questions) and its one-token answer, in the model's chat template:
the reader is asked "K?" only; the oracle "K?", "K=L?" and, over two panels, "K1?" / "K2?", each question next to
its sibling, whose image K/V its text rows see below layer 3 (bundled.reader.swap). Loss:

    the answer token and <|im_end|> (cross-entropy on the language model's output), plus
    an auxiliary per-image-token loss: the vision tower's merged output of each image token is classified as its
    key and as its value by dot products with the token embeddings of the key letters and of the answers (plus a
    learned "no field" vector each). It teaches the vision tower to read within a few hundred steps, and to say
    what it read in the language model's own embedding space, where the question's key token can find it;
    the question's key token is asked for the answer too (a one-hop signal: without it the model learned to read
    values but not to pick the field whose key was asked, and answered with a random field's value); so is each
    question token that can name a value (``Question.hops``).

``--moved SHARE`` draws that share of the oracle's questions over moved panels (bundled.reader.panels.Placement:
the content off the token grid by up to 14 pixels either way, down, right or both, inside one more row or column of
cells, the way a scrolled page or a panned frame shows it; a question and its sibling moved alike); each image
token is then labelled with the key whose glyph's centre it holds and that key's value, wherever the value's glyph
fell (``reading_targets``). Its own curriculum starts at 1-2 pixels off the grid and widens by 2 each time the
running accuracy on moved panels passes 85%. ``--vision-steps N`` first trains the vision tower alone for N steps,
on the auxiliary loss only (the token embeddings held as targets), over panels moved by every offset at once; the
whole model then trains on every offset without the curriculum. Measured: 1,500 steps of the tower alone (0.45 s
each, a third of a whole step) then 2,500 of the whole model read 86% of held-out panels moved 1-14 px, where the
curriculum alone had reached 4 px in 2,000 steps (30%). ``--fine-tune``
starts every weight from committed ones (and the field curriculum at full difficulty).

A curriculum starts with panels of at most 2 fields and raises the cap by 2 each time the running accuracy passes
90%, up to 26. Batches are drawn from a generator seeded by (seed, step), so a resumed run sees the same data.
Progress goes to stdout; every ``--eval-every`` steps the held-out accuracy (a fixed set of full-difficulty
questions) and a checkpoint are written. ``--export`` writes the committed artifacts (bundled.reader.artifacts).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from bundled.build import build_recipe
from bundled.reader import artifacts, swap
from bundled.reader.batches import Batcher, single_token, token_targets
from bundled.reader.panels import CELL, KEYS, MAX_SIDE, VALUES, Placement, random_panel
from bundled.reader.questions import (
    FIELD,
    QUESTION_KINDS,
    RELATIONAL_KINDS,
    Question,
    random_question,
    sibling,
)
from bundled.recipes import DEEP_READER, ORACLE, QWEN2_5_VL, READER, get_recipe
from bundled.weights import checkpoint_name

DEFAULT_SEED = 20261129
HELD_OUT_SEED = 7
REACH_STEP = 2  # pixels: how far the moved panels' curriculum widens at a time
VISION, WHOLE = "vision", "whole"  # the phases of a run: the vision tower alone (--vision-steps), then every weight
VISION_LR = 3e-3
VISION_MOVED = 0.85  # the share of the vision phase's panels drawn moved


@dataclass(frozen=True)
class Task:
    """What a reader is trained on: question kinds (drawn uniformly) and the sibling swap (bundled.reader.swap)."""

    kinds: tuple[str, ...]
    swap_layers: int = 0  # the question's rows see a sibling's image K/V below this decoder layer; 0: never
    # The alternative to the swap, for measurement: until this step the question's rows see no image below
    # swap_layers (bundled.reader.swap's withhold), then the whole image as usual. 0: swap instead.
    withhold_until: int = 0
    moved: float = 0.0  # the share of questions over moved panels (random_placement; --moved)
    weights: tuple[float, ...] = ()  # how often each kind is drawn (default: uniformly)
    # Notes: each image token's hidden state at the input of this decoder layer is taught to name the values of its
    # neighbours to the left and above (an auxiliary loss, bundled.reader.batches.neighbour_targets); 0: never.
    notes_layer: int = 0

    def kind(self, rng: random.Random) -> str:
        if not self.weights:
            return rng.choice(self.kinds)
        return rng.choices(self.kinds, weights=self.weights)[0]


TASKS = {
    READER: Task(kinds=(FIELD,)),
    # Reading below layer 3 is useless in training: a warmup of 3 of its 8 layers over stale KV gives stale answers.
    ORACLE: Task(kinds=QUESTION_KINDS, swap_layers=3),
    # The oracle's questions and the relational ones, drawn three times as often (they are new to the layers it grows
    # from the oracle); the same swap below layer 3.
    # Notes at the input of layer 3: below it the question sees a sibling's image, so the relational answers have to
    # come from what the named field's token holds from layer 3 up, which is what it noted of its neighbours.
    DEEP_READER: Task(kinds=QUESTION_KINDS + RELATIONAL_KINDS, swap_layers=3, weights=(1, 1, 1, 3, 3),
                      notes_layer=3),
}


def random_placement(rng: random.Random, reach: int = CELL // 2) -> Placement:
    """Content moved off the token grid down, right or both, by at most ``reach`` pixels either way (inside one more
    row or column of cells: ``reach`` of CELL // 2 covers every offset)."""
    pad = rng.choice(((1, 0), (0, 1), (1, 1)))

    def offset(padded: int) -> int:
        if not padded:
            return 0
        moved = rng.randint(1, reach)
        return moved if rng.random() < 0.5 else CELL - moved

    return Placement(top=offset(pad[0]), left=offset(pad[1]), pad=pad)


def max_side(placement: Placement) -> int:
    """The most cells a side of a panel drawn at ``placement`` may have: a moved panel's image has one more row or
    column of cells, at most MAX_SIDE with it."""
    return MAX_SIDE - 1 if placement.pad != (0, 0) else MAX_SIDE


def examples(rng: random.Random, count: int, max_fields: int) -> list[Question]:
    """The reader's questions: ``field`` only."""
    return [random_question(rng, FIELD, max_fields=max_fields) for _ in range(count)]


def draw(rng: random.Random, task: Task, count: int, max_fields: int,
         reach: int = CELL // 2) -> tuple[list[Question], list[Placement]]:
    """A batch of ``count`` questions and where each one's panels are drawn (moved by at most ``reach`` pixels); with
    a swap, ``count // 2`` questions followed by their siblings (each placed as its question)."""
    if not task.swap_layers:
        return examples(rng, count, max_fields), [Placement()] * count
    questions, placements = [], []
    for _ in range(count // 2):
        placement = random_placement(rng, reach) if task.moved and rng.random() < task.moved else Placement()
        questions.append(random_question(rng, task.kind(rng), max_fields=max_fields,
                                         max_side=max_side(placement)))
        placements.append(placement)
    return questions + [sibling(q, rng) for q in questions], placements + placements


def held_out(count: int, task: Task | None = None, seed: int = HELD_OUT_SEED) -> list[Question]:
    """Full-difficulty questions from a generator the training batches never use (``count`` per kind)."""
    rng = random.Random(f"held-out:{seed}")
    if task is None or task.kinds == (FIELD,):
        return examples(rng, count, len(KEYS))
    return [random_question(rng, kind) for kind in task.kinds for _ in range(count)]


def held_out_moved(count: int, task: Task, seed: int = HELD_OUT_SEED) -> tuple[list[Question], list[Placement]]:
    """Full-difficulty questions over moved panels (``count`` per kind), for a task that trains on them."""
    rng = random.Random(f"held-out-moved:{seed}")
    placements = [random_placement(rng) for _ in range(count * len(task.kinds))]
    questions = [random_question(rng, kind, max_side=MAX_SIDE - 1) for kind in task.kinds for _ in range(count)]
    return questions, placements


class Trainer:
    def __init__(self, model, processor, *, task: Task, seed: int, batch: int, lr: float, steps: int,
                 vision_steps: int = 0, vision_lr: float = VISION_LR) -> None:
        if task.swap_layers and batch % 2:
            raise ValueError("with a sibling swap the batch holds question/sibling pairs: it must be even")
        if vision_steps and not task.moved:
            raise ValueError("a vision phase teaches the tower to read moved panels: it needs a task with moved ones")
        if not 0 <= vision_steps < steps:
            raise ValueError(f"the vision phase ({vision_steps} steps) must leave steps for the whole model ({steps})")
        self.model, self.batcher, self.task = model, Batcher(processor), task
        if task.swap_layers:
            swap.install(model)
        hidden = model.config.text_config.hidden_size
        tokenizer = processor.tokenizer
        self.key_ids = torch.tensor([single_token(tokenizer, key) for key in KEYS])
        self.value_ids = torch.tensor([self.batcher.value_ids[value] for value in VALUES])
        self.no_field = torch.nn.Parameter(torch.zeros(2, hidden))
        # Training-only: the maps from a token's hidden state to what it noted of its left and upper neighbours.
        self.notes = torch.nn.Linear(hidden, 2 * hidden, bias=False) if task.notes_layer else None
        params = [*model.parameters(), self.no_field, *(self.notes.parameters() if self.notes else ())]
        self.optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
        self.seed, self.batch, self.lr, self.steps = seed, batch, lr, steps
        self.vision_steps, self.vision_lr = vision_steps, vision_lr
        self.step, self.level, self.running = 0, 2, 0.0
        # Moved panels' curriculum: offsets up to ``reach`` px off the grid, widened by REACH_STEP each time the
        # running accuracy on them passes 85%, up to every offset. After a vision phase the tower reads every offset:
        # no curriculum.
        self.reach, self.running_moved = (CELL // 2 if vision_steps else REACH_STEP), 0.0
        self.elapsed = 0.0
        self._vision_out: list[torch.Tensor] = []
        model.model.visual.register_forward_hook(lambda _m, _i, out: self._vision_out.append(out.pooler_output))

    @property
    def phase(self) -> str:
        return VISION if self.step < self.vision_steps else WHOLE

    def learning_rate(self) -> float:
        """Warmup, then a cosine down to a tenth, over each phase: the vision phase at ``vision_lr``, the rest at
        ``lr``."""
        if self.phase == VISION:
            peak, step, steps = self.vision_lr, self.step, self.vision_steps
        else:
            peak, step, steps = self.lr, self.step - self.vision_steps, self.steps - self.vision_steps
        warmup = min(200, steps // 10)
        if step < warmup:
            return peak * (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))

    def train_step(self) -> dict:
        if self.phase == VISION:
            return self.vision_step()
        rng = random.Random(f"{self.seed}:{self.step}")
        questions, placements = draw(rng, self.task, self.batch, self.level, self.reach)
        inputs = self.batcher(questions, placements=placements)
        for group in self.optimizer.param_groups:
            group["lr"] = self.learning_rate()
        self.model.train()
        self._vision_out.clear()
        with swap.swapping(self._swap(inputs["input_ids"])):
            out = self.model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                             pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"],
                             labels=inputs["labels"], output_hidden_states=bool(self.notes))
        aux = self.reading_loss(self._vision_out[-1], inputs["token_keys"], inputs["token_values"])[0]
        if self.notes is not None:
            image = inputs["input_ids"] == self.model.config.image_token_id
            aux = aux + self.notes_loss(out.hidden_states[self.task.notes_layer][image], inputs["token_left"],
                                        inputs["token_above"])
        # The question's key token itself (and each token that can name a value: bundled.reader.questions) is
        # taught to name the value: one content-matching hop, with its own signal; the answer position then only
        # has to look a fixed distance back.
        hops = F.cross_entropy(out.logits[inputs["hop_rows"], inputs["hop_at"]], inputs["hop_values"])
        loss = out.loss + 0.5 * aux + 0.5 * hops
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        predicted = out.logits[torch.arange(len(questions)), inputs["answer_at"]].argmax(-1)
        accuracy = (predicted == inputs["answers"]).float().mean().item()
        self.running = accuracy if self.step == 0 else 0.95 * self.running + 0.05 * accuracy
        moved = torch.tensor([placement != Placement() for placement in placements])
        if moved.any():
            right = (predicted == inputs["answers"])[moved].float().mean().item()
            self.running_moved = 0.95 * self.running_moved + 0.05 * right
            if self.running_moved >= 0.85 and self.reach < CELL // 2:
                self.reach = min(CELL // 2, self.reach + REACH_STEP)
                self.running_moved = 0.0
        self.step += 1
        if self.running >= 0.9 and self.level < len(KEYS):
            self.level = min(len(KEYS), self.level + 2)
            self.running = 0.0
        return {"loss": out.loss.item(), "aux": aux.item(), "early": hops.item(), "accuracy": accuracy}

    def reading_loss(self, vision: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     tables_fixed: bool = False) -> tuple[torch.Tensor, float]:
        """The auxiliary loss of the tower's merged output (a row per image token) against each token's key and
        value classes, and the share of the tokens showing a field whose key and value both came out right.
        ``tables_fixed``: the token embeddings are targets only (the language model reads them as they are)."""
        embeddings = self.model.get_input_embeddings().weight
        if tables_fixed:
            embeddings = embeddings.detach()
        key_table = torch.cat([self.no_field[:1], embeddings[self.key_ids]])
        value_table = torch.cat([self.no_field[1:], embeddings[self.value_ids]])
        key_logits, value_logits = vision @ key_table.T, vision @ value_table.T
        loss = F.cross_entropy(key_logits, keys) + F.cross_entropy(value_logits, values)
        with torch.no_grad():
            shown = (keys > 0) | (values > 0)
            right = (key_logits.argmax(-1) == keys) & (value_logits.argmax(-1) == values)
            read = right[shown].float().mean().item() if shown.any() else 1.0
        return loss, read

    def notes_loss(self, hidden: torch.Tensor, left: torch.Tensor, above: torch.Tensor) -> torch.Tensor:
        """The notes' auxiliary loss: each image token's hidden state (a row each), mapped by ``notes``, classified
        as the value of its left and of its upper neighbour (VALUE_CLASSES, EMPTY where no field is there)."""
        assert self.notes is not None
        value_table = torch.cat([self.no_field[1:], self.model.get_input_embeddings().weight[self.value_ids]])
        hidden = F.rms_norm(hidden, hidden.shape[-1:])  # the residual stream's scale grows with depth
        to_left, to_above = self.notes(hidden).chunk(2, dim=-1)
        return F.cross_entropy(to_left @ value_table.T, left) + F.cross_entropy(to_above @ value_table.T, above)

    def vision_step(self) -> dict:
        """A step of the vision phase: the tower alone, on its auxiliary loss, over panels moved by any offset
        (VISION_MOVED of them; the rest as drawn). ``accuracy`` is the share of field tokens read right."""
        rng = random.Random(f"{self.seed}:vision:{self.step}")
        shown = []
        for _ in range(self.batch):
            placement = random_placement(rng) if rng.random() < VISION_MOVED else Placement()
            shown.append((random_panel(rng, max_side=max_side(placement)), placement))
        images = self.batcher.processor.image_processor(
            images=[placement.render(panel) for panel, placement in shown], return_tensors="pt")
        keys, values = token_targets(shown)
        for group in self.optimizer.param_groups:
            group["lr"] = self.learning_rate()
        visual = self.model.model.visual
        visual.train()
        self._vision_out.clear()
        visual(images["pixel_values"], grid_thw=images["image_grid_thw"])
        loss, read = self.reading_loss(self._vision_out[-1], keys, values, tables_fixed=True)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(visual.parameters(), 1.0)
        self.optimizer.step()
        self.step += 1
        return {"loss": loss.item(), "aux": loss.item(), "early": 0.0, "accuracy": read}

    def _swap(self, input_ids: torch.Tensor) -> swap.Swap | None:
        """Each question's partner is its sibling, half a batch away (``draw``)."""
        task = self.task
        if not task.swap_layers or (task.withhold_until and self.step >= task.withhold_until):
            return None
        half = len(input_ids) // 2
        partner = torch.cat([torch.arange(half) + half, torch.arange(half)])
        return swap.Swap.over(input_ids, self.model.config.image_token_id, partner, task.swap_layers,
                              withhold=bool(task.withhold_until))

    def state(self) -> dict:
        return {"model": self.model.state_dict(), "no_field": self.no_field.detach().clone(),
                **({"notes": self.notes.state_dict()} if self.notes is not None else {}),
                "optimizer": self.optimizer.state_dict(),
                "step": self.step, "level": self.level, "running": self.running, "elapsed": self.elapsed,
                "reach": self.reach, "running_moved": self.running_moved}

    def load(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        with torch.no_grad():
            self.no_field.copy_(state["no_field"])
        if self.notes is not None:
            self.notes.load_state_dict(state["notes"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.level, self.running = state["step"], state["level"], state["running"]
        self.reach, self.running_moved = state.get("reach", REACH_STEP), state.get("running_moved", 0.0)
        self.elapsed = state["elapsed"]


@torch.no_grad()
def accuracy(model, batcher: Batcher, questions: list[Question], batch: int = 64,
             placements: list[Placement] | None = None) -> float:
    """Greedy first-token accuracy of full-prefill answers."""
    return overall(accuracy_by_kind(model, batcher, questions, batch, placements), questions)


def overall(by_kind: dict[str, float], questions: list[Question]) -> float:
    """The accuracy over all questions, from the accuracy per kind."""
    counts = Counter(q.kind for q in questions)
    return sum(by_kind[kind] * counts[kind] for kind in counts) / len(questions)


@torch.no_grad()
def accuracy_by_kind(model, batcher: Batcher, questions: list[Question], batch: int = 64,
                     placements: list[Placement] | None = None) -> dict[str, float]:
    """Greedy first-token accuracy of full-prefill answers, per question kind (each question's panels drawn at its
    placement, default as drawn)."""
    model.eval()
    placements = placements or [Placement()] * len(questions)
    right: Counter[str] = Counter()
    for start in range(0, len(questions), batch):
        chunk = questions[start : start + batch]
        inputs = batcher(chunk, with_answers=False, placements=placements[start : start + batch])
        logits = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                       pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"]).logits
        predicted = logits[torch.arange(len(chunk)), inputs["answer_at"]].argmax(-1)
        for question, ok in zip(chunk, (predicted == inputs["answers"]).tolist(), strict=True):
            right[question.kind] += ok
    counts = Counter(q.kind for q in questions)
    return {kind: right[kind] / counts[kind] for kind in counts}


def warm_start(model, arch: str, trained: str) -> int:
    """Copy the vision tower (patch embedding, blocks, merger) and the token embeddings of committed weights into
    ``model``; returns how many tensors were copied."""
    weights = artifacts.load_trained(trained, torch.float32)
    params = dict(model.named_parameters())
    copied = 0
    with torch.no_grad():
        for name, param in params.items():
            stored = checkpoint_name(arch, name)
            if (stored.startswith("visual.") or stored == "model.embed_tokens.weight") and stored in weights:
                if weights[stored].shape != param.shape:
                    raise ValueError(f"{trained}: {stored} is {tuple(weights[stored].shape)}, the model's "
                                     f"{tuple(param.shape)}")
                param.copy_(weights[stored])
                copied += 1
    return copied


def grow_start(model, arch: str, trained: str) -> tuple[int, int]:
    """Start a deeper model from committed weights of the same widths: every tensor of ``trained`` is copied to the
    parameter of the same name (its decoder layers to the first layers), and each decoder layer it lacks starts with
    its attention's and MLP's output projections at zero, so that the layer adds nothing to the residual stream and
    the grown model computes what the trained one did. Returns (tensors copied, layers added)."""
    weights = artifacts.load_trained(trained, torch.float32)
    params = dict(model.named_parameters())
    names = {checkpoint_name(arch, name): name for name in params}
    missing = [stored for stored in weights if stored not in names]
    if missing:
        raise ValueError(f"{trained} has {len(missing)} tensors the model lacks, e.g. {missing[0]}")
    with torch.no_grad():
        for stored, tensor in weights.items():
            param = params[names[stored]]
            if tensor.shape != param.shape:
                raise ValueError(f"{trained}: {stored} is {tuple(tensor.shape)}, the model's {tuple(param.shape)}")
            param.copy_(tensor)
        added = 0
        for index, layer in enumerate(model.model.language_model.layers):
            if checkpoint_name(arch, f"model.language_model.layers.{index}.self_attn.o_proj.weight") in weights:
                continue
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
            added += 1
    return len(weights), added


def held_out_record(model, batcher: Batcher, questions: list[Question],
                    moved: tuple[list[Question], list[Placement]] | None = None) -> dict:
    """The held-out accuracy for the log: overall, and per kind when there are several; over moved panels too
    (``held_out_moved_*``) where the task trains on them."""
    by_kind = accuracy_by_kind(model, batcher, questions)
    record: dict = {"held_out_accuracy": round(overall(by_kind, questions), 4)}
    if len(by_kind) > 1:
        record["held_out_by_kind"] = {kind: round(value, 4) for kind, value in by_kind.items()}
    if moved:
        by_kind = accuracy_by_kind(model, batcher, moved[0], placements=moved[1])
        record["held_out_moved_accuracy"] = round(overall(by_kind, moved[0]), 4)
        record["held_out_moved_by_kind"] = {kind: round(value, 4) for kind, value in by_kind.items()}
    return record


def fine_tune_start(model, arch: str, trained: str) -> int:
    """Copy every weight of committed ``trained`` weights into ``model``; returns how many tensors were copied."""
    weights = artifacts.load_trained(trained, torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            stored = checkpoint_name(arch, name)
            if stored not in weights or weights[stored].shape != param.shape:
                raise ValueError(f"{trained} has no {stored} of shape {tuple(param.shape)}")
            param.copy_(weights[stored])
    return len(weights)


def export(model, recipe, out_dir: Path, summary: dict, log_path: Path, config_path: Path) -> Path:
    """Write the committed artifacts: bfloat16 weights under checkpoint names, the model's config.json, the log, a
    summary, checksums."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / artifacts.CONFIG).write_bytes(config_path.read_bytes())
    tensors = {checkpoint_name(recipe.arch, name): param.detach().to(torch.bfloat16).contiguous()
               for name, param in model.named_parameters()}
    save_file(tensors, str(out_dir / artifacts.WEIGHTS), metadata={"format": "pt"})
    (out_dir / artifacts.LOG).write_bytes(log_path.read_bytes())
    (out_dir / artifacts.SUMMARY).write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    artifacts.write_sums(out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=tuple(TASKS), default=READER, help="which reader (its recipe and task)")
    parser.add_argument("--work", type=Path, default=None,
                        help="checkpoints and the running log, resumed from if present (default scratch/<size>)")
    parser.add_argument("--steps", type=int, default=6000)
    parser.add_argument("--batch", type=int, default=48)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--eval-questions", type=int, default=256, help="held-out questions (per kind)")
    parser.add_argument("--stop-at", type=int, default=None,
                        help="stop at this step (with a checkpoint); the same command without it continues")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--init-from", default=None, metavar="TRAINED",
                        help="start the vision tower and token embeddings from committed weights "
                             "(e.g. qwen2_5_vl-reader); the language model's layers start from the recipe's")
    parser.add_argument("--fine-tune", default=None, metavar="TRAINED",
                        help="start every weight from committed weights (e.g. qwen2_5_vl-oracle); the curriculum "
                             "starts at full difficulty")
    parser.add_argument("--grow-from", default=None, metavar="TRAINED",
                        help="start every weight from committed weights of a shallower model of the same widths (e.g. "
                             "qwen2_5_vl-oracle for the deep reader); the layers it lacks start as no-ops")
    parser.add_argument("--from-checkpoint", type=Path, default=None, metavar="CHECKPOINT",
                        help="start every weight of the model from an earlier run's checkpoint.pt (its optimizer and "
                             "schedule are not taken): a second stage of a run, e.g. at another --start-level")
    parser.add_argument("--start-level", type=int, default=None, metavar="FIELDS",
                        help="start the field curriculum at this many fields a panel (default 2; 26 with --fine-tune)")
    parser.add_argument("--withhold-until", type=int, default=0, metavar="STEP",
                        help="oracle, for measurement: instead of the sibling swap, hide the image from the "
                             "question below the swap layer until STEP, then show it")
    parser.add_argument("--moved", type=float, default=0.0, metavar="SHARE",
                        help="oracle: this share of the questions over panels moved off the token grid (a curriculum "
                             "from 2 px), so that it reads content moved by part of a token")
    parser.add_argument("--vision-steps", type=int, default=0, metavar="STEPS",
                        help="with --moved: train the vision tower alone for the first STEPS steps (of --steps), on "
                             "its auxiliary loss over panels moved by any offset, before every weight")
    parser.add_argument("--vision-lr", type=float, default=VISION_LR, help="the vision phase's peak learning rate")
    parser.add_argument("--export", type=Path, default=None,
                        help="when done, write the committed artifacts here (e.g. bundled/reader/trained/"
                             "qwen2_5_vl-<size>)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    args.work = args.work or Path("scratch") / args.size

    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    recipe, task = get_recipe(QWEN2_5_VL, args.size), TASKS[args.size]
    if args.withhold_until:
        if not task.swap_layers:
            parser.error(f"--withhold-until needs a reader trained with a swap layer (not {args.size})")
        task = dataclasses.replace(task, withhold_until=args.withhold_until)
    if args.moved:
        if not task.swap_layers:
            parser.error(f"--moved is for the oracle's task (not {args.size})")
        task = dataclasses.replace(task, moved=args.moved)
    start = build_recipe(dataclasses.replace(recipe, trained=""), on_progress=print)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(start, dtype=torch.float32)
    processor = AutoProcessor.from_pretrained(start)
    if args.init_from:
        print(f"vision tower and embeddings from {args.init_from}: {warm_start(model, recipe.arch, args.init_from)} "
              f"tensors")
    if args.fine_tune:
        print(f"every weight from {args.fine_tune}: {fine_tune_start(model, recipe.arch, args.fine_tune)} tensors")
    if args.grow_from:
        copied, added = grow_start(model, recipe.arch, args.grow_from)
        print(f"grown from {args.grow_from}: {copied} tensors copied, {added} decoder layers added as no-ops")
    earlier = torch.load(args.from_checkpoint, weights_only=False) if args.from_checkpoint else None
    if earlier is not None:
        model.load_state_dict(earlier["model"])
        print(f"every weight from {args.from_checkpoint} (step {earlier['step']}, level {earlier['level']})")
    try:
        trainer = Trainer(model, processor, task=task, seed=args.seed, batch=args.batch, lr=args.lr,
                          steps=args.steps, vision_steps=args.vision_steps, vision_lr=args.vision_lr)
    except ValueError as exc:
        parser.error(str(exc))
    if args.fine_tune:
        trainer.level = len(KEYS)
    if args.start_level is not None:
        trainer.level = max(2, min(len(KEYS), args.start_level))
    if earlier is not None:  # the training-only heads too, so the auxiliary losses go on where they were
        with torch.no_grad():
            trainer.no_field.copy_(earlier["no_field"])
        if trainer.notes is not None and "notes" in earlier:
            trainer.notes.load_state_dict(earlier["notes"])
    args.work.mkdir(parents=True, exist_ok=True)
    checkpoint, log_path = args.work / "checkpoint.pt", args.work / artifacts.LOG
    if checkpoint.is_file():
        trainer.load(torch.load(checkpoint, weights_only=False))
        print(f"resumed at step {trainer.step} (level {trainer.level}, {trainer.elapsed / 60:.1f} min trained)")
    else:
        log_path.write_text("")
    questions = held_out(args.eval_questions, task)
    moved = held_out_moved(args.eval_questions, task) if task.moved else None
    params = sum(p.numel() for p in model.parameters())
    print(f"training {recipe.name}: {params / 1e6:.2f}M parameters, {args.steps} steps of {args.batch}")
    window: list[dict] = []
    stop = min(args.steps, args.stop_at or args.steps)
    while trainer.step < stop:
        began = time.perf_counter()
        window.append(trainer.train_step())
        trainer.elapsed += time.perf_counter() - began
        last = trainer.step == stop
        if trainer.step % 25 == 0 or last:
            mean = {key: sum(r[key] for r in window) / len(window) for key in window[0]}
            window.clear()
            record = {"step": trainer.step, "minutes": round(trainer.elapsed / 60, 2),
                      **({"phase": VISION} if trainer.step <= trainer.vision_steps else {}), "level": trainer.level,
                      **({"reach": trainer.reach} if task.moved else {}),
                      "lr": round(trainer.learning_rate(), 6), **{k: round(v, 4) for k, v in mean.items()}}
            if trainer.step % args.eval_every == 0 or last:
                record.update(held_out_record(model, trainer.batcher, questions, moved))
                torch.save(trainer.state(), checkpoint.with_suffix(".tmp"))
                checkpoint.with_suffix(".tmp").replace(checkpoint)
            with log_path.open("a") as handle:
                handle.write(json.dumps(record) + "\n")
            print(json.dumps(record), flush=True)
    if args.export and trainer.step == args.steps:
        final = held_out_record(model, trainer.batcher, questions, moved)
        summary = {**final, "recipe": recipe.name, "seed": args.seed, "steps": args.steps, "batch": args.batch,
                   "lr": args.lr, "minutes": round(trainer.elapsed / 60, 1), "parameters": params,
                   **({"vision_steps": args.vision_steps, "vision_lr": args.vision_lr} if args.vision_steps else {}),
                   "command": " ".join(["python -m bundled.reader.train",
                                        *(argv if argv is not None else sys.argv[1:])])}
        written = export(model, recipe, args.export, summary, log_path, start / "config.json")
        print(f"exported to {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
