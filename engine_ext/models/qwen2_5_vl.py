"""Qwen2.5-VL for SGLang workers, registered under SGLang's own class name."""

from sglang.srt.models.qwen2_5_vl import (
    Qwen2_5_VLForConditionalGeneration as _SGLangQwen2_5_VL,
)

from engine_ext.executor.model import ExecutesPlans


class Qwen2_5_VLForConditionalGeneration(ExecutesPlans, _SGLangQwen2_5_VL):
    """SGLang's Qwen2.5-VL executing the reuse plans requests carry (engine_ext.executor)."""


EntryClass = Qwen2_5_VLForConditionalGeneration
