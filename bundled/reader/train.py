"""Train the reader from scratch on CPU: ``python -m bundled.reader.train``.

The model is the bundled ``qwen2_5_vl`` / ``reader`` recipe (transformers' Qwen2.5-VL classes, the bundled tokenizer
and processor), starting from the recipe's deterministic random weights. Each example is a generated panel
(bundled.reader.panels), the question "K?" and the one-token answer, in the model's chat template. Loss:

    the answer token and <|im_end|> (cross-entropy on the language model's output), plus
    an auxiliary per-image-token loss: the vision tower's merged output of each image token is classified as its
    key and as its value by dot products with the token embeddings of the key letters and of the answers (plus a
    learned "no field" vector each). It teaches the vision tower to read within a few hundred steps, and to say
    what it read in the language model's own embedding space, where the question's key token can find it;
    the question's key token is asked for the answer too (a one-hop signal: without it the model learned to read
    values but not to pick the field whose key was asked, and answered with a random field's value).

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
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from bundled.build import build_recipe
from bundled.reader import artifacts
from bundled.reader.panels import KEYS, VALUES, Panel, random_panel
from bundled.recipes import QWEN2_5_VL, READER, get_recipe
from bundled.weights import checkpoint_name

DEFAULT_SEED = 20261129
HELD_OUT_SEED = 7
EMPTY = "-"  # the auxiliary class of an image token that shows no field


class Batcher:
    """Turns (panel, key) examples into model inputs with the bundled processor and chat template."""

    def __init__(self, processor) -> None:
        self.processor = processor
        tokenizer = processor.tokenizer
        tokenizer.padding_side = "right"
        self.value_ids = value_token_ids(tokenizer)
        self.im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.vision_end = tokenizer.convert_tokens_to_ids("<|vision_end|>")

    def prompt(self, question: str) -> str:
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        return self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def __call__(self, examples: list[tuple[Panel, str]], with_answers: bool = True) -> dict:
        texts = [self.prompt(panel.question(key)) + (panel.value(key) + "<|im_end|>" if with_answers else "")
                 for panel, key in examples]
        inputs = self.processor(text=texts, images=[panel.render() for panel, _ in examples], padding=True,
                                return_tensors="pt")
        lengths = inputs["attention_mask"].sum(1)
        answers = torch.tensor([self.value_ids[panel.value(key)] for panel, key in examples])
        offset = 2 if with_answers else 0
        # The position whose logits predict the answer: the last prompt token.
        inputs["answer_at"] = lengths - 1 - offset
        # The question's key token, right after the image.
        inputs["key_at"] = (inputs["input_ids"] == self.vision_end).int().argmax(1) + 1
        inputs["answers"] = answers
        if with_answers:
            labels = torch.full_like(inputs["input_ids"], -100)
            rows = torch.arange(len(examples))
            labels[rows, lengths - 2] = answers
            labels[rows, lengths - 1] = self.im_end
            inputs["labels"] = labels
        keys, values = [], []
        for panel, _ in examples:
            shown = token_labels(panel)
            for token in range(panel.rows * panel.cols):
                key, value = shown.get(token, (EMPTY, EMPTY))
                keys.append(KEY_CLASSES.index(key))
                values.append(VALUE_CLASSES.index(value))
        inputs["token_keys"], inputs["token_values"] = torch.tensor(keys), torch.tensor(values)
        return inputs


def token_labels(panel: Panel) -> dict[int, tuple[str, str]]:
    """What each image token shows: a field's first token its key and value; a word's second token the word."""
    labels = {}
    for key in panel.keys:
        first, *rest = panel.token_indices(key)
        labels[first] = (key, panel.value(key))
        labels.update((token, (EMPTY, panel.value(key))) for token in rest)
    return labels


KEY_CLASSES = (EMPTY, *KEYS)
VALUE_CLASSES = (EMPTY, *VALUES)


def value_token_ids(tokenizer) -> dict[str, int]:
    """Every answer's token id (each answer is one token)."""
    return {value: _single_token(tokenizer, value) for value in VALUES}


def _single_token(tokenizer, text: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"answer {text!r} is {len(ids)} tokens in the bundled tokenizer; answers must be one")
    return ids[0]


def examples(rng: random.Random, count: int, max_fields: int) -> list[tuple[Panel, str]]:
    out = []
    for _ in range(count):
        panel = random_panel(rng, max_fields=max_fields)
        out.append((panel, rng.choice(panel.keys)))
    return out


def held_out(count: int, seed: int = HELD_OUT_SEED) -> list[tuple[Panel, str]]:
    """Full-difficulty questions from a generator the training batches never use."""
    return examples(random.Random(f"held-out:{seed}"), count, len(KEYS))


class Trainer:
    def __init__(self, model, processor, *, seed: int, batch: int, lr: float, steps: int) -> None:
        self.model, self.batcher = model, Batcher(processor)
        hidden = model.config.text_config.hidden_size
        tokenizer = processor.tokenizer
        self.key_ids = torch.tensor([_single_token(tokenizer, key) for key in KEYS])
        self.value_ids = torch.tensor([self.batcher.value_ids[value] for value in VALUES])
        self.no_field = torch.nn.Parameter(torch.zeros(2, hidden))
        params = [*model.parameters(), self.no_field]
        self.optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
        self.seed, self.batch, self.lr, self.steps = seed, batch, lr, steps
        self.step, self.level, self.running = 0, 2, 0.0
        self.elapsed = 0.0
        self._vision_out: list[torch.Tensor] = []
        model.model.visual.register_forward_hook(lambda _m, _i, out: self._vision_out.append(out.pooler_output))

    def learning_rate(self) -> float:
        warmup = min(200, self.steps // 10)
        if self.step < warmup:
            return self.lr * (self.step + 1) / warmup
        progress = (self.step - warmup) / max(1, self.steps - warmup)
        return self.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))

    def train_step(self) -> dict:
        rng = random.Random(f"{self.seed}:{self.step}")
        inputs = self.batcher(examples(rng, self.batch, self.level))
        for group in self.optimizer.param_groups:
            group["lr"] = self.learning_rate()
        self.model.train()
        self._vision_out.clear()
        out = self.model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                         pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"],
                         labels=inputs["labels"])
        vision = self._vision_out[-1]
        embeddings = self.model.get_input_embeddings().weight
        key_table = torch.cat([self.no_field[:1], embeddings[self.key_ids]])
        value_table = torch.cat([self.no_field[1:], embeddings[self.value_ids]])
        aux = (F.cross_entropy(vision @ key_table.T, inputs["token_keys"])
               + F.cross_entropy(vision @ value_table.T, inputs["token_values"]))
        rows = torch.arange(self.batch)
        # The key token itself is taught to name the value: one content-matching hop, with its own signal; the
        # answer position then only has to look a fixed distance back.
        early = F.cross_entropy(out.logits[rows, inputs["key_at"]], inputs["answers"])
        loss = out.loss + 0.5 * aux + 0.5 * early
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        predicted = out.logits[rows, inputs["answer_at"]].argmax(-1)
        accuracy = (predicted == inputs["answers"]).float().mean().item()
        self.running = accuracy if self.step == 0 else 0.95 * self.running + 0.05 * accuracy
        self.step += 1
        if self.running >= 0.9 and self.level < len(KEYS):
            self.level = min(len(KEYS), self.level + 2)
            self.running = 0.0
        return {"loss": out.loss.item(), "aux": aux.item(), "early": early.item(), "accuracy": accuracy}

    def state(self) -> dict:
        return {"model": self.model.state_dict(), "no_field": self.no_field.detach().clone(),
                "optimizer": self.optimizer.state_dict(),
                "step": self.step, "level": self.level, "running": self.running, "elapsed": self.elapsed}

    def load(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        with torch.no_grad():
            self.no_field.copy_(state["no_field"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.level, self.running = state["step"], state["level"], state["running"]
        self.elapsed = state["elapsed"]


@torch.no_grad()
def accuracy(model, batcher: Batcher, questions: list[tuple[Panel, str]], batch: int = 64) -> float:
    """Greedy first-token accuracy of full-prefill answers."""
    model.eval()
    right = 0
    for start in range(0, len(questions), batch):
        chunk = questions[start : start + batch]
        inputs = batcher(chunk, with_answers=False)
        logits = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                       pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"]).logits
        predicted = logits[torch.arange(len(chunk)), inputs["answer_at"]].argmax(-1)
        right += int((predicted == inputs["answers"]).sum())
    return right / len(questions)


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
    parser.add_argument("--work", type=Path, default=Path("scratch/reader"),
                        help="checkpoints and the running log (resumed from if present)")
    parser.add_argument("--steps", type=int, default=6000)
    parser.add_argument("--batch", type=int, default=48)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--eval-questions", type=int, default=256)
    parser.add_argument("--stop-at", type=int, default=None,
                        help="stop at this step (with a checkpoint); the same command without it continues")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--export", type=Path, default=None,
                        help="when done, write the committed artifacts here (e.g. bundled/reader/trained/"
                             "qwen2_5_vl-reader)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    recipe = get_recipe(QWEN2_5_VL, READER)
    start = build_recipe(dataclasses.replace(recipe, trained=""), on_progress=print)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(start, dtype=torch.float32)
    processor = AutoProcessor.from_pretrained(start)
    trainer = Trainer(model, processor, seed=args.seed, batch=args.batch, lr=args.lr, steps=args.steps)
    args.work.mkdir(parents=True, exist_ok=True)
    checkpoint, log_path = args.work / "checkpoint.pt", args.work / artifacts.LOG
    if checkpoint.is_file():
        trainer.load(torch.load(checkpoint, weights_only=False))
        print(f"resumed at step {trainer.step} (level {trainer.level}, {trainer.elapsed / 60:.1f} min trained)")
    else:
        log_path.write_text("")
    questions = held_out(args.eval_questions)
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
            record = {"step": trainer.step, "minutes": round(trainer.elapsed / 60, 2), "level": trainer.level,
                      "lr": round(trainer.learning_rate(), 6), **{k: round(v, 4) for k, v in mean.items()}}
            if trainer.step % args.eval_every == 0 or last:
                record["held_out_accuracy"] = round(accuracy(model, trainer.batcher, questions), 4)
                torch.save(trainer.state(), checkpoint.with_suffix(".tmp"))
                checkpoint.with_suffix(".tmp").replace(checkpoint)
            with log_path.open("a") as handle:
                handle.write(json.dumps(record) + "\n")
            print(json.dumps(record), flush=True)
    if args.export and trainer.step == args.steps:
        final = accuracy(model, trainer.batcher, questions)
        summary = {"recipe": recipe.name, "seed": args.seed, "steps": args.steps, "batch": args.batch,
                   "lr": args.lr, "minutes": round(trainer.elapsed / 60, 1), "parameters": params,
                   "held_out_accuracy": final,
                   "command": " ".join(["python -m bundled.reader.train",
                                        *(argv if argv is not None else sys.argv[1:])])}
        written = export(model, recipe, args.export, summary, log_path, start / "config.json")
        print(f"exported to {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
