"""The gateway's one configuration object.

Every setting lives in :class:`GatewayConfig`; environment variables are read in one
place (:meth:`GatewayConfig.from_env`) with the ``REVISIT_`` prefix. A bad value fails
loudly at start-up, never at request time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.config.errors import ConfigError
from gateway.config.limits import AdmissionLimits
from gateway.config.media import ImageLimits, ProcessorSettings, VideoSettings
from gateway.config.responses import ResponseCacheSettings
from gateway.config.reuse import MatchSettings, PolicySettings, ReuseSettings
from gateway.config.tenants import KEYS, OPEN, TenantSettings, read_key_file
from gateway.costs import ModelFacts
from plan import (
    DEFAULT_RECOMPUTE_RATIO,
)
from plan.checkpoint import longest_token_chars, vocab_size
from settings import PREFIX as ENV_PREFIX
from settings import EnvReader
from settings.redis_auth import RedisPasswordError, RedisURL, with_password
from settings.secret import DataPlaneSecret, SecretError
from store.config import ENV_PREFIX as STORE_ENV_PREFIX
from store.config import StoreConfig
from store.errors import ConfigError as StoreConfigError


@dataclass(frozen=True, kw_only=True)
class GatewayConfig:
    """Everything the gateway needs to run; immutable once built."""

    model: str
    workers: tuple[str, ...]
    processor: ProcessorSettings = field(default_factory=ProcessorSettings)
    # The model's vocabulary size (from REVISIT_MODEL_DIR): /v1/completions token-id prompts are checked against it,
    # since an id past it crashes an SGLang worker; unknown, such prompts are refused.
    vocab_size: int | None = None
    # The most characters of text one token of the model's vocabulary stands for (from REVISIT_MODEL_DIR's
    # tokenizer.json): what bounds a prompt's tokens from below (gateway/prompt_size.py); unknown, text is not counted.
    max_token_chars: int | None = None
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
    # every books_follow_interval_s. The server's password, if it asks for one, is read from books_password_file
    # (settings/redis_auth.py); the URL is shown with any password in it masked.
    books_url: str | None = None
    books_password_file: Path | None = None
    books_follow_interval_s: float = 0.1
    # Which API keys are served and the cache namespace of each (gateway/config/tenants.py). The default serves
    # only listed keys, and lists none: an operator lists them, or asks for open mode (a laptop's `revisit serve`).
    tenants: TenantSettings = field(default_factory=TenantSettings)
    # The deployment secret shared with the workers (REVISIT_STORE_SECRET_FILE, settings/secret.py): plans are
    # authenticated with it, and the store seals entries under it. Unset: public keys (integrity only).
    secret: DataPlaneSecret = field(default_factory=DataPlaneSecret)
    # Requests and body bytes in flight, overall and per API key, and the body's deadline (gateway/admission.py).
    admission: AdmissionLimits = field(default_factory=AdmissionLimits)
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
    # What a request's work depends on in the model (layers, KV bytes, vision patches: from REVISIT_MODEL_DIR), and
    # whether each worker's costs are measured when it comes up (gateway/calibration.py); without the model's facts
    # nothing is.
    model_facts: ModelFacts | None = None
    calibrate: bool = True
    # Whether the planner sends only plans predicted to pay (gateway/planner.py); off, every plan that can be made is
    # sent (to exercise or measure the reuse paths where they do not pay: the soak, the reuse benches).
    plan_by_cost: bool = True

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
        if self.books_url is not None:
            object.__setattr__(self, "books_url", RedisURL(self.books_url))  # shown with its password masked
            if not self.books_url.startswith(("redis://", "rediss://", "unix://")):
                raise ConfigError(f"books_url must be a redis://, rediss:// or unix:// URL, got {self.books_url!r}")
        if self.books_password_file is not None and self.books_url is None:
            raise ConfigError("books_password_file is set without books_url")
        if self.metrics_require_token and not self.admin_token:
            raise ConfigError("metrics_require_token needs an admin_token")

    @property
    def books_address(self) -> RedisURL | None:
        """The books' server as the gateway connects to it: books_url with the password of books_password_file
        in it (read now), shown masked; None without shared books. Raises ConfigError for an unusable file."""
        if self.books_url is None:
            return None
        try:
            return with_password(self.books_url, self.books_password_file)
        except RedisPasswordError as exc:
            raise ConfigError(str(exc)) from None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, *, open_by_default: bool = False,
                 **overrides: Any) -> GatewayConfig:
        """Build from ``REVISIT_*`` variables; keyword overrides win over the environment. ``open_by_default``:
        without REVISIT_AUTH or a key file, serve any key (``revisit serve``); otherwise only listed keys.

        REVISIT_MODEL, REVISIT_WORKERS (comma-separated URLs), REVISIT_MODEL_DIR (to read
        processor settings), REVISIT_AUTH (keys/open), REVISIT_API_KEYS_FILE (lines '<namespace> <key or
        sha256:digest>'), REVISIT_NAMESPACES (JSON object key -> namespace),
        REVISIT_ALLOW_PRIVATE_IMAGE_URLS (0/1), REVISIT_MAX_IMAGES_PER_REQUEST,
        REVISIT_MAX_IMAGE_BYTES, REVISIT_MAX_IMAGE_PIXELS, REVISIT_MAX_REQUEST_BYTES, REVISIT_IMAGE_MEMO_BYTES,
        REVISIT_UPSTREAM_TIMEOUT_S, REVISIT_HEALTH_INTERVAL_S, REVISIT_HEALTH_TIMEOUT_S,
        REVISIT_BOOKS_INTERVAL_S, REVISIT_BOOKS_URL, REVISIT_BOOKS_PASSWORD_FILE, REVISIT_ADMIN_TOKEN,
        REVISIT_METRICS_REQUIRE_TOKEN (0/1), REVISIT_VIDEO_* (VideoSettings), REVISIT_RESPONSE_CACHE_*
        (ResponseCacheSettings), and the cache policy's
        REVISIT_DRAM_CAPACITY_BYTES, REVISIT_LMDB_CAPACITY_BYTES, REVISIT_PRESET_FRACTION,
        REVISIT_MAX_PROTECTION_BUDGET, REVISIT_PRESET_REUSE_WEIGHT, REVISIT_PRESET_MIN_SCORE.
        """
        env = EnvReader(environ, error=ConfigError)

        readers: dict[type, Callable[[str, Any], Any]] = {str: env.string, int: env.integer, float: env.number,
                                                          bool: env.flag, Path: env.path}

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
            kwargs["max_token_chars"] = longest_token_chars(model_dir)
            kwargs["model_facts"] = ModelFacts.from_model_dir(model_dir)
        image_kwargs = {
            key: value
            for key, value in (
                ("max_images_per_request", get("MAX_IMAGES_PER_REQUEST", int)),
                ("max_image_bytes", get("MAX_IMAGE_BYTES", int)),
                ("max_image_pixels", get("MAX_IMAGE_PIXELS", int)),
                ("max_request_pixels", get("MAX_REQUEST_PIXELS", int)),
                ("max_decoding_pixels", get("MAX_DECODING_PIXELS", int)),
                ("resize_to_model", get("RESIZE_IMAGES_TO_MODEL", bool)),
                ("forward_decoded", get("FORWARD_DECODED_IMAGES", bool)),
                ("allow_private_urls", get("ALLOW_PRIVATE_IMAGE_URLS", bool)),
                ("fetch_deadline_s", get("FETCH_DEADLINE_S", float)),
            )
            if value is not None
        }
        if image_kwargs:
            kwargs["images"] = ImageLimits(**image_kwargs)
        kwargs["videos"] = VideoSettings.from_env(env.environ)
        kwargs["admission"] = AdmissionLimits.from_env(env.environ)
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
            ("books_password_file", "BOOKS_PASSWORD_FILE", Path),
            ("books_follow_interval_s", "BOOKS_FOLLOW_INTERVAL_S", float),
            ("keep_alive_s", "KEEP_ALIVE_S", float),
            ("calibrate", "CALIBRATE", bool),
            ("plan_by_cost", "PLAN_BY_COST", bool),
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
        kwargs["tenants"] = _tenants_from_env(env, open_by_default=open_by_default)
        try:
            kwargs["secret"] = DataPlaneSecret.read(env.path(STORE_ENV_PREFIX + "SECRET_FILE"))
        except SecretError as exc:
            raise ConfigError(str(exc)) from None
        kwargs.update(overrides)
        missing = [name for name in ("model", "workers") if name not in kwargs]
        if missing:
            raise ConfigError(
                "missing settings: " + ", ".join(ENV_PREFIX + m.upper() for m in missing)
            )
        config = cls(**kwargs)
        # The books' and the outcomes' passwords read now, so that a file missing or unusable stops the start.
        config.books_address  # noqa: B018
        if config.reuse.store is not None:
            try:
                config.reuse.store.outcomes_address  # noqa: B018
            except StoreConfigError as exc:
                raise ConfigError(str(exc)) from None
        config.tenants.require_keys()  # last, so that a setting missing or wrong is named first
        if config.tenants.mode == KEYS and not config.secret.configured:
            raise ConfigError(
                f"keys mode needs the deployment secret the workers share: set {STORE_ENV_PREFIX}SECRET_FILE on the "
                "gateway and every worker to one file of 32 random bytes (`revisit keys secret FILE` makes one), "
                "so that nobody who reaches the store or a worker can forge what they use")
        return config


def _tenants_from_env(env: EnvReader, *, open_by_default: bool) -> TenantSettings:
    """REVISIT_AUTH, REVISIT_API_KEYS_FILE and REVISIT_NAMESPACES (plain keys, as a JSON object key -> namespace)."""
    key_file = env.path(ENV_PREFIX + "API_KEYS_FILE")
    mode = env.string(ENV_PREFIX + "AUTH") or (OPEN if open_by_default and key_file is None else KEYS)
    keys = read_key_file(key_file) if key_file is not None else {}
    if (namespaces := env.json(ENV_PREFIX + "NAMESPACES")) is not None:
        if not isinstance(namespaces, dict) or not all(isinstance(v, str) for v in namespaces.values()):
            raise ConfigError(f"{ENV_PREFIX}NAMESPACES must be a JSON object of strings")
        listed = TenantSettings.with_keys(namespaces) if mode == KEYS else TenantSettings.open(namespaces)
        if set(listed.keys) & set(keys):
            raise ConfigError(f"a key is listed both in {ENV_PREFIX}NAMESPACES and in {ENV_PREFIX}API_KEYS_FILE")
        keys.update(listed.keys)
    return TenantSettings(mode=mode, keys=keys)
