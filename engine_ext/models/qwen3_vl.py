"""Qwen3-VL for SGLang workers, registered under SGLang's own class name."""

from sglang.srt.models.qwen3_vl import (
    Qwen3VLForConditionalGeneration as _SGLangQwen3VL,
)

from engine_ext.models import announce


class Qwen3VLForConditionalGeneration(_SGLangQwen3VL):
    """SGLang's Qwen3-VL, unchanged for now.

    Later this class executes reuse plans: it will take cached visual K/V (and the deepstack
    features that go with them) for image spans that the gateway matched and recompute only the
    rows the plan selects.
    """

    revisit_extension = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        announce(self)


EntryClass = Qwen3VLForConditionalGeneration
