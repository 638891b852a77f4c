"""The gateway's configuration: :class:`GatewayConfig` and the settings it holds, one concern a module.

- :mod:`gateway.config.gateway_config`: ``GatewayConfig``, the one object, and where ``REVISIT_*`` is read.
- :mod:`gateway.config.media`: the model's image processing, image and video limits.
- :mod:`gateway.config.reuse`: approximate matching, reuse planning, the cache policy's capacities and knobs.
- :mod:`gateway.config.responses`: the response cache.
- :mod:`gateway.config.tenants`: who may call (API keys) and the cache namespace of each.
- :mod:`gateway.config.limits`: how much work callers may have in flight.
- :mod:`gateway.config.errors`: ``ConfigError``.
"""

from gateway.config.errors import ConfigError
from gateway.config.gateway_config import GatewayConfig
from gateway.config.limits import AdmissionLimits
from gateway.config.media import ImageLimits, ProcessorSettings, VideoSettings
from gateway.config.responses import RESPONSE_CACHE_LEVELS, RESPONSE_CACHE_OFF, ResponseCacheSettings
from gateway.config.reuse import EXTRACTORS, MatchSettings, PolicySettings, ReuseSettings
from gateway.config.tenants import KEYS, OPEN, TenantSettings, key_digest

__all__ = [
    "EXTRACTORS", "KEYS", "OPEN", "RESPONSE_CACHE_LEVELS", "RESPONSE_CACHE_OFF", "AdmissionLimits", "ConfigError",
    "GatewayConfig", "ImageLimits", "MatchSettings", "PolicySettings", "ProcessorSettings", "ResponseCacheSettings",
    "ReuseSettings", "TenantSettings", "VideoSettings", "key_digest",
]
