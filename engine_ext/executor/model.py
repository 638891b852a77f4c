"""The part every plan-executing model class shares; mixed in ahead of SGLang's class of the same name."""

from __future__ import annotations

import logging
from pathlib import Path

from engine_ext.executor.deployment import check_worker
from engine_ext.executor.executor import PlanExecutor
from engine_ext.models import announce

log = logging.getLogger(__name__)


class ExecutesPlans:
    """Routes extend batches through a PlanExecutor and counts the images the vision tower encodes.

    Use as ``class X(ExecutesPlans, SGLangX)``; SGLang's class does everything else.
    """

    revisit_extension = True
    config: object  # SGLang's model config, set by the model class this is mixed into

    def __init__(self, *args, **kwargs) -> None:
        check_worker()  # settings the extension refuses stop the worker here, named (executor.deployment)
        super().__init__(*args, **kwargs)
        self.executor = PlanExecutor(self, model_id=model_id_of(self.config))
        announce(self)

    def prepare_for_forward(self, forward_batch) -> None:
        """SGLang's model runner calls this on every batch before it decides whether the batch replays a CUDA graph
        (ModelRunner._forward_raw); a replay runs no Python, so a decode batch the executor must run is kept off."""
        prepare = getattr(super(), "prepare_for_forward", None)
        if prepare is not None:
            prepare(forward_batch)
        self.executor.keep_off_graph(forward_batch)

    def forward(self, input_ids, positions, forward_batch, *args, **kwargs):
        engine = super()
        return self.executor.forward(
            input_ids, forward_batch, lambda: engine.forward(input_ids, positions, forward_batch, *args, **kwargs))

    def get_image_feature(self, items):
        self.executor.events.add("vision_images", len(items))
        log.info("revisit: vision tower encoded %d image(s)", len(items))
        return super().get_image_feature(items)


def model_id_of(config) -> str:
    """Entries are tagged with the checkpoint directory's name (bundled models: arch, size and recipe digest)."""
    return Path(getattr(config, "_name_or_path", "") or "model").name
