"""Qwen3-VL for SGLang workers, registered under SGLang's own class name."""

import logging

from sglang.srt.models.qwen3_vl import (
    Qwen3VLForConditionalGeneration as _SGLangQwen3VL,
)

from engine_ext.executor.executor import PlanExecutor
from engine_ext.models import announce
from engine_ext.models.qwen2_5_vl import model_id_of

log = logging.getLogger(__name__)


class Qwen3VLForConditionalGeneration(_SGLangQwen3VL):
    """SGLang's Qwen3-VL executing the reuse plans requests carry (engine_ext.executor); the stored encoder output
    holds the deepstack features beside the embeddings, as SGLang's encoder cache does."""

    revisit_extension = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.executor = PlanExecutor(self, model_id=model_id_of(self.config))
        announce(self)

    def forward(self, input_ids, positions, forward_batch, *args, **kwargs):
        return self.executor.forward(
            input_ids, forward_batch, lambda: super(Qwen3VLForConditionalGeneration, self).forward(
                input_ids, positions, forward_batch, *args, **kwargs))

    def get_image_feature(self, items):
        self.executor.stats["vision_images"] += len(items)
        log.info("revisit: vision tower encoded %d image(s)", len(items))
        return super().get_image_feature(items)


EntryClass = Qwen3VLForConditionalGeneration
