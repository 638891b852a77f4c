"""config.json, generation_config.json and processor_config.json of a bundled model.

The configs are built with transformers' own config and processor classes (which validate them)
and then written as plain JSON with sorted keys, so the bytes only depend on the recipe.
"""

from __future__ import annotations

import json
from typing import Any

from transformers import (
    PretrainedConfig,
    Qwen2_5_VLConfig,
    Qwen2_5_VLProcessor,
    Qwen2VLImageProcessor,
    Qwen3VLConfig,
    Qwen3VLProcessor,
)
from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

from bundled.recipes import QWEN2_5_VL, QWEN3_VL, ModelRecipe
from bundled.tokenizer import MODEL_MAX_LENGTH, SpecialTokenIds

ARCHITECTURE_CLASS = {
    QWEN2_5_VL: "Qwen2_5_VLForConditionalGeneration",
    QWEN3_VL: "Qwen3VLForConditionalGeneration",
}

# Normalisation constants of the two families' image processors.
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_HALF = (0.5, 0.5, 0.5)


def padded_vocab_size(ids: SpecialTokenIds) -> int:
    """Embedding rows: the tokenizer's size rounded up to a multiple of 128, as Qwen does."""
    return -(-ids.vocab_size // 128) * 128


def hf_config(recipe: ModelRecipe, ids: SpecialTokenIds) -> PretrainedConfig:
    """The transformers config object of ``recipe``."""
    text, vision = recipe.text, recipe.vision
    text_config: dict[str, Any] = {
        "vocab_size": padded_vocab_size(ids),
        "hidden_size": text.hidden_size,
        "intermediate_size": text.intermediate_size,
        "num_hidden_layers": text.num_layers,
        "num_attention_heads": text.num_heads,
        "num_key_value_heads": text.num_kv_heads,
        "max_position_embeddings": MODEL_MAX_LENGTH,
        "rms_norm_eps": 1e-6,
        "bos_token_id": ids.endoftext,
        "eos_token_id": ids.im_end,
        "pad_token_id": ids.endoftext,
        "dtype": recipe.dtype,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": text.rope_theta,
            "mrope_section": list(text.mrope_section),
        },
    }
    vision_config: dict[str, Any] = {
        "depth": vision.depth,
        "hidden_size": vision.hidden_size,
        "num_heads": vision.num_heads,
        "intermediate_size": vision.intermediate_size,
        "patch_size": vision.patch_size,
        "spatial_merge_size": vision.spatial_merge_size,
        "temporal_patch_size": vision.temporal_patch_size,
        "out_hidden_size": text.hidden_size,
        "in_channels": 3,
    }
    if recipe.arch == QWEN2_5_VL:
        if text.head_dim * text.num_heads != text.hidden_size:
            raise ValueError("Qwen2.5-VL derives head_dim from hidden_size / num_heads")
        vision_config |= {
            "fullatt_block_indexes": list(vision.fullatt_block_indexes),
            "window_size": vision.window_size,
        }
        config_cls: type[Qwen2_5_VLConfig | Qwen3VLConfig] = Qwen2_5_VLConfig
    else:
        text_config["head_dim"] = text.head_dim
        text_config["rope_parameters"]["mrope_interleaved"] = True
        vision_config |= {
            "deepstack_visual_indexes": list(vision.deepstack_visual_indexes),
            "num_position_embeddings": vision.num_position_embeddings,
        }
        config_cls = Qwen3VLConfig
    return config_cls(
        text_config=text_config,
        vision_config=vision_config,
        tie_word_embeddings=recipe.tie_word_embeddings,
        architectures=[ARCHITECTURE_CLASS[recipe.arch]],
        dtype=recipe.dtype,
        image_token_id=ids.image_pad,
        video_token_id=ids.video_pad,
        vision_start_token_id=ids.vision_start,
        vision_end_token_id=ids.vision_end,
    )


def config_json(recipe: ModelRecipe, ids: SpecialTokenIds) -> dict[str, Any]:
    """config.json content. SGLang's Qwen2/2.5-VL vision tower reads ``in_chans``."""
    config = hf_config(recipe, ids).to_diff_dict()
    config["vision_config"]["in_chans"] = 3
    return config


def generation_config_json(ids: SpecialTokenIds) -> dict[str, Any]:
    """Token ids only. Without sampling defaults here, SGLang (``--sampling-defaults model``) has
    nothing to apply and requests get the OpenAI defaults (temperature 1, top_p 1)."""
    return {
        "bos_token_id": ids.endoftext,
        "eos_token_id": [ids.im_end, ids.endoftext],
        "pad_token_id": ids.endoftext,
    }


def processor_config_json(recipe: ModelRecipe, tokenizer: Any) -> dict[str, Any]:
    """processor_config.json: image and video processor settings and the processor class."""
    vision = recipe.vision
    qwen3 = recipe.arch == QWEN3_VL
    common = {
        "patch_size": vision.patch_size,
        "merge_size": vision.spatial_merge_size,
        "temporal_patch_size": vision.temporal_patch_size,
        "image_mean": list(_HALF if qwen3 else _CLIP_MEAN),
        "image_std": list(_HALF if qwen3 else _CLIP_STD),
    }
    image_processor = Qwen2VLImageProcessor(
        size={"shortest_edge": recipe.min_pixels, "longest_edge": recipe.max_pixels}, **common
    )
    if qwen3:
        processor: Any = Qwen3VLProcessor(
            image_processor=image_processor,
            tokenizer=tokenizer,
            video_processor=Qwen3VLVideoProcessor(**common),
        )
    else:
        processor = Qwen2_5_VLProcessor(
            image_processor=image_processor,
            tokenizer=tokenizer,
            video_processor=Qwen2VLVideoProcessor(**common),
        )
    return json.loads(processor.to_json_string())
