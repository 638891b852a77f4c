"""What the gateway may reuse and how much it keeps: approximate matching, reuse planning, the cache policy."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.config.errors import ConfigError
from plan import (
    DEFAULT_RECOMPUTE_RATIO,
    DOWNSTREAM,
    PARTIAL_PASS,
    PROFILE_FILE,
    SELECTORS,
    VISION_PASSES,
    PlanError,
    RecomputeProfile,
    check_ratios,
)
from plan.checkpoint import text_layers
from settings import PREFIX as ENV_PREFIX
from settings import EnvReader
from store.config import StoreConfig, Tier

MATCH_ENV_PREFIX = ENV_PREFIX + "MATCH_"
EXTRACTORS = ("pixel", "encoder", "clip")  # gateway/matching/pixel.py, encoder.py, clip.py
MAX_SUBTOKEN_PX = 13  # under half a token of Qwen2.5-VL's 28 pixels: at half, which token content came from is a tie


@dataclass(frozen=True, kw_only=True)
class MatchSettings:
    """Approximate matching and approximate plans (gateway/matching, gateway/planner.py), ``REVISIT_MATCH_<FIELD>``.

    Lookup: the coarse stage keeps ``candidates`` entries whose every 2 x 2 regional cosine exceeds
    ``coarse_threshold``; the fine stage matches when the mean per-token cosine over the aligned grid reaches
    ``match_threshold``; a token is similar at ``patch_threshold`` when none of its shades (4 x 4-pixel grey
    levels) moved by more than ``max_shade_change``; tokens under ``blank_entropy`` bits are blank.
    A candidate that falls short in place is aligned again when the content moved by part of a token, at most
    ``max_subtoken_px_y`` off the grid vertically and ``max_subtoken_px_x`` horizontally, with a motion of at least
    ``min_motion_confidence``.
    Plans: B = the lowest-entropy ``reuse_share`` of the tokens, R = ``recompute_share`` of them, ``warmup_layers``
    layers on every token first; the guard plans a miss when more than ``max_changed_share`` of the tokens changed.
    ``selector`` is the default selector (plan.SELECTORS); a request may name another in the ``x-revisit-selector``
    header only when ``allow_selector_header``. ``vision_pass`` is where approximate plans take the new image's
    encoder output from (plan.VISION_PASSES): ``partial`` runs the vision tower over the changed tokens and their
    margin only, the alias' stored output elsewhere; ``full`` over the whole image. ``derive``: the worker stores
    what an approximate plan computed as a derived entry (store.entry.EntryHeader.derived_from).
    """

    enabled: bool = True
    extractor: str = "pixel"
    # Where an extractor's weights are: the VLM's model folder for "encoder" (default: REVISIT_MODEL_DIR), an
    # open_clip model folder for "clip" (required). Never downloaded.
    extractor_path: Path | None = None
    coarse_threshold: float = 0.8
    candidates: int = 5
    match_threshold: float = 0.9
    patch_threshold: float = 0.95
    # Measured on the reader's panels (one field redrawn) and their JPEG re-encodes: quality 50 moves no 4 x 4 cell
    # by more than 11 grey levels; of the edited tokens a cosine of 0.95 let through as similar (a fifth of them),
    # three quarters moved a cell by more than 24, and those under 16 differ by antialiasing alone.
    max_shade_change: int = 16
    blank_entropy: float = 0.5
    reuse_share: float = 0.1
    recompute_share: float = 0.3
    warmup_layers: int = 3
    max_changed_share: float = 0.35  # measured: near-duplicates changed <= 0.29, a form with every value redrawn 0.41
    # Content moved by part of a token (gateway/matching/moved.py) is planned only this many pixels off the token
    # grid, per axis (0: never on that axis; 13: every remainder but half a 28-pixel token). Measured by the oracle
    # fine-tuned on moved panels (bench/moved_quality.py): reuse holds within 2 points of a full prefill for content
    # scrolled by any remainder, and panned up to 5 px off the grid; not at half a token, where the gateway's own
    # plans of a scroll by 42 px answered 24% of changed fields right against a full prefill's 91%.
    max_subtoken_px_y: int = 13
    max_subtoken_px_x: int = 5
    # The motion's confidence (motion.find_motion on the two images' shades) under which no sub-token move is tried:
    # on the moved panels the right move scored 0.29 and more; a move tried wrongly costs a decode and an extraction,
    # not a wrong plan (the realigned tokens must still match).
    min_motion_confidence: float = 0.15
    # The default selector, measured (bench/approximate_quality.py): on the oracle, entropy_aware drops the tokens
    # outside R and B, and answered 75% of unchanged-field questions right where attention_only (nothing dropped)
    # and a full prefill answered 100%. On the deep reader's relational questions (the field next to a changed one,
    # whose token took notes of its old value; docs/notes/2026-12-07-deep-reader.md) attention_only at W 3 answered
    # 20-28 points below a full prefill, reading stale notes; downstream, which recomputes the tokens right after and
    # right below each changed one first (and refuses a plan that cannot: refused=notes), held.
    selector: str = DOWNSTREAM
    allow_selector_header: bool = False
    vision_pass: str = PARTIAL_PASS
    # Approximate hits leave a derived entry (the K/V the hit computed, marked with its alias), so the image's next
    # sight is exact; never where the selector dropped tokens, and never an alias itself.
    derive: bool = True
    # Entries of one grid searched by a plain scan; an HNSW graph past it. Measured (bench/matching.py, coarse stage
    # alone): the scan is faster up to about 10k entries (0.8 ms against 1.3), the graph at 100k (1.3 ms against 7.7).
    scan_limit: int = 16384
    feature_cache_bytes: int = 256 << 20  # per-token features kept in memory for the fine stage
    pending_grace_s: float = 600.0  # how long an indexed image may wait for its worker to store the entry

    def __post_init__(self) -> None:
        if self.extractor not in EXTRACTORS:
            raise ConfigError(f"match extractor must be one of {EXTRACTORS}, got {self.extractor!r}")
        if self.extractor == "encoder" and self.extractor_path is None:
            raise ConfigError("the encoder extractor needs a model folder: set REVISIT_MATCH_EXTRACTOR_PATH or "
                              "REVISIT_MODEL_DIR")
        if self.extractor == "clip" and self.extractor_path is None:
            raise ConfigError("the clip extractor needs an open_clip model folder: set REVISIT_MATCH_EXTRACTOR_PATH")
        if self.selector not in SELECTORS:
            raise ConfigError(f"match selector must be one of {SELECTORS}, got {self.selector!r}")
        if self.vision_pass not in VISION_PASSES:
            raise ConfigError(f"match vision_pass must be one of {VISION_PASSES}, got {self.vision_pass!r}")
        for name in ("coarse_threshold", "match_threshold", "patch_threshold", "reuse_share", "recompute_share",
                     "max_changed_share"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"match {name} must be in [0, 1], got {getattr(self, name)}")
        if not 0 <= self.max_shade_change <= 255:
            raise ConfigError(f"match max_shade_change must be a grey level in [0, 255], got {self.max_shade_change}")
        for name in ("max_subtoken_px_y", "max_subtoken_px_x"):
            if not 0 <= getattr(self, name) <= MAX_SUBTOKEN_PX:
                raise ConfigError(f"match {name} must be in [0, {MAX_SUBTOKEN_PX}] (pixels off the token grid, "
                                  f"under half a token), got {getattr(self, name)}")
        if self.min_motion_confidence < 0:
            raise ConfigError(f"match min_motion_confidence must not be negative, got {self.min_motion_confidence}")
        if self.candidates < 1 or self.scan_limit < 1 or self.warmup_layers < 0:
            raise ConfigError("match candidates and scan_limit must be positive, warmup_layers not negative")
        if self.blank_entropy < 0 or self.feature_cache_bytes < 0 or self.pending_grace_s < 0:
            raise ConfigError("match blank_entropy, feature_cache_bytes and pending_grace_s must not be negative")

    def plans_moves(self) -> bool:
        """Whether content moved by part of a token is ever lined up again (a bound above 0 on an axis)."""
        return self.max_subtoken_px_y > 0 or self.max_subtoken_px_x > 0

    def plans_offset(self, offset: tuple[int, int]) -> bool:
        """Whether content ``offset`` (dy, dx) pixels off the token grid (after whole tokens) is planned: off the
        grid, and within each axis' bound."""
        return offset != (0, 0) and abs(offset[0]) <= self.max_subtoken_px_y and \
            abs(offset[1]) <= self.max_subtoken_px_x

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, *, model_dir: str | Path | None = None) -> \
            MatchSettings:
        env = EnvReader(environ, error=ConfigError)
        for old, instead in RETIRED.items():
            if env.raw(old) is not None:
                raise ConfigError(f"{old} {instead}")
        fields = env.fields(cls, MATCH_ENV_PREFIX)
        if fields.get("extractor") == "encoder" and fields.get("extractor_path") is None and model_dir is not None:
            fields["extractor_path"] = Path(model_dir)
        return cls(**fields)


# Settings read no more, and what to set instead: a gateway started with one stops and says so rather than ignore it.
RETIRED = {"REVISIT_MATCH_STRATEGY": "is now REVISIT_MATCH_SELECTOR (the same values)",
           "REVISIT_MATCH_ALLOW_STRATEGY_HEADER": "is now REVISIT_MATCH_ALLOW_SELECTOR_HEADER (the same values)",
           "REVISIT_MATCH_MAX_SUBTOKEN_PX": "is now one bound per axis: set REVISIT_MATCH_MAX_SUBTOKEN_PX_Y "
                                            "(vertical) and REVISIT_MATCH_MAX_SUBTOKEN_PX_X (horizontal)"}


@dataclass(frozen=True, kw_only=True)
class ReuseSettings:
    """Reuse planning (gateway/planner.py): the store it reads, and how much of a moved image to recompute.

    ``store`` None attaches no store and plans nothing (every request runs as in plain SGLang). ``ratios`` are
    per-layer recompute ratios for an image stored after another prefix; None (the layer count is unknown) has
    such images recomputed in full. ``layers`` is the language model's layer count when known (it bounds the
    approximate plans' warmup). ``match`` configures approximate matching.
    """

    enabled: bool = True
    store: StoreConfig | None = None
    ratios: tuple[float, ...] | None = None
    ratios_source: str = "none"
    layers: int | None = None
    match: MatchSettings = field(default_factory=MatchSettings)

    def __post_init__(self) -> None:
        if self.ratios is not None:
            try:
                object.__setattr__(self, "ratios", check_ratios(self.ratios))
            except PlanError as exc:
                raise ConfigError(f"recompute ratios: {exc}") from None
        if self.store is not None and len(self.store.tiers) > 2:
            # The books (gateway/policy) keep two levels: an upper tier and a lower one.
            raise ConfigError(f"the gateway manages one or two store tiers, got {','.join(self.store.tiers)}")

    @classmethod
    def for_model(cls, model_dir: str | Path | None, *, store: StoreConfig | None, enabled: bool = True,
                  profile: str | Path | None = None, uniform_ratio: float = DEFAULT_RECOMPUTE_RATIO,
                  match: MatchSettings | None = None) -> ReuseSettings:
        """Ratios from a recompute profile (the given path, else MODEL_DIR/recompute_profile.json when present),
        else uniform_ratio at every layer of the model in model_dir; none when the layer count is unknown."""
        if not 0.0 <= uniform_ratio <= 1.0:
            raise ConfigError(f"recompute ratio must be in [0, 1], got {uniform_ratio}")
        layers = text_layers(model_dir) if model_dir else None
        common: dict[str, Any] = {"enabled": enabled, "store": store, "layers": layers,
                                  "match": match or MatchSettings()}
        candidate = Path(profile) if profile else (Path(model_dir) / PROFILE_FILE if model_dir else None)
        if candidate is not None and (profile or candidate.is_file()):
            try:
                loaded = RecomputeProfile.load(candidate)
            except PlanError as exc:
                raise ConfigError(str(exc)) from None
            return cls(ratios=loaded.ratios, ratios_source=f"profile {candidate}", **common)
        if layers is None:
            return cls(**common)
        return cls(ratios=(uniform_ratio,) * layers, ratios_source=f"uniform {uniform_ratio} over {layers} layers",
                   **common)


@dataclass(frozen=True, kw_only=True)
class PolicySettings:
    """Capacities and knobs of the gateway's cache policy (see :mod:`gateway.policy`).

    A capacity per store tier; the books use those of the store's tiers. ``preset_fraction`` of the upper tier
    (DRAM, or mooncake when it is the only one) is reserved for the preset victim cache: ordinary entries there use
    the rest, preset entries only that share.
    """

    dram_capacity_bytes: int = 16 * 1024**3
    lmdb_capacity_bytes: int = 256 * 1024**3
    mooncake_capacity_bytes: int = 64 * 1024**3
    preset_fraction: float = 0.1
    max_protection_budget: int = 4
    # Online reuse signal: an entry's preset score is its prior weight plus this much
    # per hit (exact or approximate); it may enter the reserved share at preset_min_score.
    preset_reuse_weight: float = 0.25
    preset_min_score: float = 1.0

    def __post_init__(self) -> None:
        if min(self.dram_capacity_bytes, self.lmdb_capacity_bytes, self.mooncake_capacity_bytes) < 0:
            raise ConfigError("tier capacities must not be negative")
        if not 0.0 <= self.preset_fraction < 1.0:
            raise ConfigError(f"preset_fraction must be in [0, 1), got {self.preset_fraction}")
        if self.max_protection_budget < 0:
            raise ConfigError("max_protection_budget must not be negative")
        if self.preset_reuse_weight < 0 or not math.isfinite(self.preset_reuse_weight):
            raise ConfigError("preset_reuse_weight must be a finite number >= 0")
        if self.preset_min_score <= 0 or not math.isfinite(self.preset_min_score):
            raise ConfigError("preset_min_score must be a finite number > 0")

    def capacity_bytes(self, tier: str) -> int:
        """The books' capacity of a store tier (dram, lmdb, mooncake)."""
        return int(getattr(self, f"{Tier(tier).value}_capacity_bytes"))

    def preset_capacity_bytes(self, tier: str = "dram") -> int:
        """The preset share of the upper tier ``tier``."""
        return int(self.capacity_bytes(tier) * self.preset_fraction)

    def main_capacity_bytes(self, tier: str = "dram") -> int:
        """The upper tier ``tier`` less its preset share."""
        return self.capacity_bytes(tier) - self.preset_capacity_bytes(tier)
