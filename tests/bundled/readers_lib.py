"""What the readers' tests share: a reader's recipe with its untrained weights, and a trained reader's reference."""

from __future__ import annotations

import dataclasses

import torch

from bundled import QWEN2_5_VL, build_model
from bundled.build import build_recipe
from bundled.recipes import get_recipe


def untrained_reader(size: str):
    """(model, processor) of a reader's recipe with its deterministic random weights (what training starts from)."""
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    path = build_recipe(dataclasses.replace(get_recipe(QWEN2_5_VL, size), trained=""))
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    return model, AutoProcessor.from_pretrained(path)


def trained_reference(size: str):
    """The committed reader of ``size`` in offline.reference."""
    from offline.reference import ReferenceModel

    return ReferenceModel.load(build_model(QWEN2_5_VL, size))
