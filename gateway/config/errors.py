"""The gateway's configuration error."""

from __future__ import annotations

from settings import SettingsError


class ConfigError(SettingsError):
    """A setting is missing or has a value the gateway cannot run with."""
