"""Qwen2.5-VL for SGLang workers, registered under SGLang's own class name."""

from sglang.srt.models.qwen2_5_vl import (
    Qwen2_5_VLForConditionalGeneration as _SGLangQwen2_5_VL,
)

from engine_ext.models import announce


class Qwen2_5_VLForConditionalGeneration(_SGLangQwen2_5_VL):
    """SGLang's Qwen2.5-VL, unchanged for now.

    Later this class executes reuse plans: it will take cached visual K/V for image spans that
    the gateway matched and recompute only the rows the plan selects.
    """

    revisit_extension = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        announce(self)


EntryClass = Qwen2_5_VLForConditionalGeneration
