"""Qwen2.5-VL for SGLang workers, registered under SGLang's own class name."""

import logging
from pathlib import Path

from sglang.srt.models.qwen2_5_vl import (
    Qwen2_5_VLForConditionalGeneration as _SGLangQwen2_5_VL,
)

from engine_ext.executor.executor import PlanExecutor
from engine_ext.models import announce

log = logging.getLogger(__name__)


class Qwen2_5_VLForConditionalGeneration(_SGLangQwen2_5_VL):
    """SGLang's Qwen2.5-VL executing the reuse plans requests carry (engine_ext.executor)."""

    revisit_extension = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.executor = PlanExecutor(self, model_id=model_id_of(self.config))
        announce(self)

    def forward(self, input_ids, positions, forward_batch, *args, **kwargs):
        return self.executor.forward(
            input_ids, forward_batch, lambda: super(Qwen2_5_VLForConditionalGeneration, self).forward(
                input_ids, positions, forward_batch, *args, **kwargs))

    def get_image_feature(self, items):
        self.executor.stats["vision_images"] += len(items)
        log.info("revisit: vision tower encoded %d image(s)", len(items))
        return super().get_image_feature(items)


def model_id_of(config) -> str:
    """Entries are tagged with the checkpoint directory's name (bundled models: arch, size and recipe digest)."""
    return Path(getattr(config, "_name_or_path", "") or "model").name


EntryClass = Qwen2_5_VLForConditionalGeneration
