"""Approximate matching: recognising a new image as a near-duplicate of a cached one, and planning its reuse.

- :mod:`gateway.matching.features`: ``TokenFeatures`` (per token: exact digest, descriptor vector, entropy) and
  the ``Extractor`` interface; :mod:`gateway.matching.pixel`: the default, weight-free extractor;
  :mod:`gateway.matching.encoder`: the VLM's own vision tower; :mod:`gateway.matching.clip`: an open_clip tower
  from a local folder.
- :mod:`gateway.matching.index`: the coarse stage (2 x 2 regional descriptors of the token layouts per namespace
  and grid, a scan or an HNSW graph) and the digest sketch.
- :mod:`gateway.matching.align`: the fine stage (whole-token shift, change map, similarity).
- :mod:`gateway.matching.motion`: motion at pixel level (phase correlation), parts of a token included, over the
  whole frame or per region.
- :mod:`gateway.matching.moved`: content moved by part of a token, found from the shades and lined up again (planned
  within ``max_subtoken_px_y`` and ``_x`` of the grid).
- :mod:`gateway.matching.matcher`: ``Matcher``, coarse to fine, with the features persisted beside the store.
- :mod:`gateway.matching.plans`: from a match to an approximate ``plan.ImagePlan`` (reuse set, guard).
"""

from __future__ import annotations

from gateway.config import ConfigError, MatchSettings, ProcessorSettings
from gateway.matching.features import Extractor
from gateway.matching.pixel import PixelExtractor


def extractor_for(settings: MatchSettings) -> Extractor:
    """The extractor the settings name (the encoder's weights are loaded here, once)."""
    if settings.extractor == "pixel":
        return PixelExtractor()
    if settings.extractor == "encoder" and settings.extractor_path is not None:
        from gateway.matching.encoder import EncoderExtractor

        return EncoderExtractor(settings.extractor_path)
    if settings.extractor == "clip" and settings.extractor_path is not None:
        from gateway.matching.clip import ClipExtractor

        return ClipExtractor(settings.extractor_path)
    raise ConfigError(f"unknown feature extractor {settings.extractor!r}")


def scope(model: str, processor: ProcessorSettings, extractor: Extractor) -> str:
    """What features are comparable within: one model, one image processor setting, one extractor."""
    return (f"{model}|{processor.patch_size},{processor.merge_size},{processor.temporal_patch_size},"
            f"{processor.min_pixels},{processor.max_pixels}|{extractor.name}")
