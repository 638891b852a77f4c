"""The HF transformers Qwen2.5-VL / Qwen3-VL model as the reference drives it: prompts, encoder outputs, pieces.

Nothing here changes the model. ``ReferenceModel`` loads a checkpoint with transformers, builds prompts with the
model's own processor and chat template, computes M-RoPE positions with the model's own ``get_rope_index``, runs
the vision tower, and exposes the decoder's modules so ``offline.reference.driver`` can run them layer by layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image

from engine_ext.rope import frequency_axes

QWEN2_5_VL = "qwen2_5_vl"
QWEN3_VL = "qwen3_vl"


@dataclass(frozen=True)
class ImageSpan:
    """Where one image's tokens sit in a prompt: rows [start, stop) and its (t, h, w) grid in LLM tokens."""

    start: int
    stop: int
    grid: tuple[int, int, int]

    @property
    def rows(self) -> range:
        return range(self.start, self.stop)

    def __len__(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Prompt:
    """A tokenised prompt: ids (T,), M-RoPE positions (3, T), its images' spans and their processor inputs."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    images: tuple[ImageSpan, ...]
    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor | None
    mm_token_type_ids: torch.Tensor

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def extended(self, tokens: Sequence[int]) -> Prompt:
        """This prompt followed by text tokens (e.g. a known answer), at the next text positions."""
        extra = torch.tensor(list(tokens), dtype=self.input_ids.dtype)
        start = int(self.positions.max()) + 1
        positions = torch.arange(start, start + len(extra)).expand(3, -1)
        return Prompt(input_ids=torch.cat([self.input_ids, extra]), positions=torch.cat([self.positions, positions], 1),
                      images=self.images, pixel_values=self.pixel_values, image_grid_thw=self.image_grid_thw,
                      mm_token_type_ids=torch.cat([self.mm_token_type_ids, torch.zeros(1, len(extra),
                                                   dtype=self.mm_token_type_ids.dtype)], 1))


@dataclass(frozen=True)
class EncoderOutput:
    """What the vision tower gives the language model for one image: one embedding per LLM token, and for
    Qwen3-VL the deepstack features added to the hidden states after the first decoder layers (one per layer)."""

    embeds: torch.Tensor  # (n, hidden)
    deepstack: tuple[torch.Tensor, ...] = ()  # each (n, hidden)

    def flat(self) -> torch.Tensor:
        """(n, hidden * (1 + len(deepstack))): the form the store keeps."""
        return torch.cat([self.embeds, *self.deepstack], dim=-1)

    @classmethod
    def from_flat(cls, flat: torch.Tensor, hidden: int) -> EncoderOutput:
        parts = flat.split(hidden, dim=-1)
        return cls(parts[0], tuple(parts[1:]))


class ReferenceModel:
    """A transformers Qwen-VL model in eval mode, on CPU, in the checkpoint's dtype unless told otherwise."""

    def __init__(self, hf_model, processor) -> None:
        self.hf = hf_model.eval()
        self.processor = processor
        self.arch = hf_model.config.model_type
        if self.arch not in (QWEN2_5_VL, QWEN3_VL):
            raise ValueError(f"unsupported model type {self.arch!r}")
        text = hf_model.model.language_model
        self.text = text
        self.layers = text.layers
        self.config = text.config
        self.num_layers = len(self.layers)
        self.hidden = self.config.hidden_size
        self.num_heads = self.config.num_attention_heads
        self.kv_heads = self.config.num_key_value_heads
        self.head_dim = getattr(self.config, "head_dim", None) or self.hidden // self.num_heads
        self.inv_freq = text.rotary_emb.inv_freq.double()  # (head_dim / 2,)
        self.frequency_axes = frequency_axes(  # (head_dim / 2,) the M-RoPE axis of each rotary frequency
            lambda positions: self.rope(positions, torch.zeros(1, dtype=torch.float32))[1], len(self.inv_freq))
        self.image_token_id = hf_model.config.image_token_id
        self.dtype = hf_model.dtype

    @classmethod
    def load(cls, path: Path | str, dtype: torch.dtype | None = None) -> ReferenceModel:
        from transformers import AutoModelForImageTextToText, AutoProcessor

        processor = AutoProcessor.from_pretrained(path)
        model = AutoModelForImageTextToText.from_pretrained(path, **({"dtype": dtype} if dtype else {}))
        return cls(model, processor)

    # --- prompts ---

    def prompt(self, content: Sequence[str | Image.Image]) -> Prompt:
        """One user turn of text pieces and images, in order, through the chat template (generation prompt on)."""
        parts, images = [], []
        for piece in content:
            if isinstance(piece, Image.Image):
                parts.append({"type": "image"})
                images.append(piece.convert("RGB"))
            else:
                parts.append({"type": "text", "text": piece})
        messages = [{"role": "user", "content": parts}]
        text = self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        inputs = self.processor(text=[text], images=images or None, return_tensors="pt")
        input_ids = inputs["input_ids"]
        grid = inputs.get("image_grid_thw")
        positions, _ = self.hf.model.get_rope_index(
            input_ids, image_grid_thw=grid, attention_mask=inputs["attention_mask"],
            mm_token_type_ids=inputs["mm_token_type_ids"],
        )
        return Prompt(
            input_ids=input_ids[0], positions=positions[:, 0], images=self._spans(input_ids[0], grid),
            pixel_values=inputs.get("pixel_values"), image_grid_thw=grid, mm_token_type_ids=inputs["mm_token_type_ids"],
        )

    def _spans(self, ids: torch.Tensor, grid: torch.Tensor | None) -> tuple[ImageSpan, ...]:
        is_image = (ids == self.image_token_id).tolist()
        starts = [i for i, flag in enumerate(is_image) if flag and (i == 0 or not is_image[i - 1])]
        merge = self.hf.model.visual.spatial_merge_size
        spans = []
        for index, start in enumerate(starts):
            assert grid is not None  # the processor gives image_grid_thw whenever the prompt has image tokens
            t, h, w = (int(x) for x in grid[index])
            n = t * h * w // (merge * merge)
            spans.append(ImageSpan(start, start + n, (t, h // merge, w // merge)))
        return tuple(spans)

    # --- the model's own pieces ---

    @torch.no_grad()
    def encode(self, prompt: Prompt) -> list[EncoderOutput]:
        """The vision tower's output for each image of the prompt."""
        if prompt.pixel_values is None:
            return []
        out = self.hf.model.get_image_features(prompt.pixel_values, prompt.image_grid_thw, return_dict=True)
        deepstack = getattr(out, "deepstack_features", None) or []
        return [EncoderOutput(embeds, tuple(layer[i] for layer in deepstack))
                for i, embeds in enumerate(out.pooler_output)]

    @torch.no_grad()
    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return self.text.embed_tokens(ids)

    @torch.no_grad()
    def rope(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (rows, head_dim) for M-RoPE positions (3, rows), exactly as the model builds them."""
        cos, sin = self.text.rotary_emb(like, positions[:, None, :])
        return cos[0], sin[0]

    @torch.no_grad()
    def logits(self, hidden_last: torch.Tensor) -> torch.Tensor:
        return self.hf.lm_head(self.text.norm(hidden_last))

    @torch.no_grad()
    def hf_forward(self, prompt: Prompt):
        """transformers' own forward over the whole prompt (logits and its KV cache): what the reference must match."""
        return self.hf(
            input_ids=prompt.input_ids[None], attention_mask=torch.ones_like(prompt.input_ids)[None],
            pixel_values=prompt.pixel_values, image_grid_thw=prompt.image_grid_thw,
            mm_token_type_ids=prompt.mm_token_type_ids, use_cache=True,
        )
