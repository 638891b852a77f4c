"""Qwen3-VL for SGLang workers, registered under SGLang's own class name."""

from sglang.srt.models.qwen3_vl import (
    Qwen3VLForConditionalGeneration as _SGLangQwen3VL,
)

from engine_ext.executor.model import ExecutesPlans


class Qwen3VLForConditionalGeneration(ExecutesPlans, _SGLangQwen3VL):
    """SGLang's Qwen3-VL executing the reuse plans requests carry (engine_ext.executor); the stored encoder output
    holds the deepstack features beside the embeddings, as SGLang's encoder cache does."""


EntryClass = Qwen3VLForConditionalGeneration
