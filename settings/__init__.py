"""Reading ``REVISIT_*`` environment variables: the one loader every part's config uses.

Each part keeps one frozen config dataclass (``GatewayConfig``, ``StoreConfig``, ``LauncherConfig``,
``BuildConfig``) and builds it with an :class:`EnvReader`, which parses a variable by the type asked for and
raises the part's own error, naming the variable, for a value it cannot parse. An empty variable counts as unset.

    env = EnvReader(os.environ, error=ConfigError)
    env.integer("REVISIT_MAX_IMAGES_PER_REQUEST")        # None when unset
    env.fields(StoreConfig, "REVISIT_STORE_")            # every REVISIT_STORE_<FIELD>, typed by the field
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

PREFIX = "REVISIT_"
_TRUE, _FALSE = ("1", "true", "yes"), ("0", "false", "no")


class SettingsError(ValueError):
    """A variable has a value its setting cannot take (the default error of an EnvReader)."""


class EnvReader:
    """Typed reads from an environment mapping (default ``os.environ``); see the module docstring."""

    def __init__(self, environ: Mapping[str, str] | None = None, *, error: type[Exception] = SettingsError) -> None:
        self.environ = os.environ if environ is None else environ
        self.error = error

    def raw(self, name: str) -> str | None:
        value = self.environ.get(name)
        return None if value is None or value == "" else value

    def string(self, name: str, default: str | None = None) -> str | None:
        value = self.raw(name)
        return default if value is None else value

    def integer(self, name: str, default: int | None = None) -> int | None:
        return self._parse(name, int, "int", default)

    def number(self, name: str, default: float | None = None) -> float | None:
        return self._parse(name, float, "float", default)

    def flag(self, name: str, default: bool | None = None) -> bool | None:
        return self._parse(name, _to_bool, "bool (0/1, true/false, yes/no)", default)

    def path(self, name: str, default: Path | None = None) -> Path | None:
        return self._parse(name, lambda raw: Path(raw).expanduser(), "path", default)

    def csv(self, name: str) -> tuple[str, ...] | None:
        """Comma-separated values, blanks dropped."""
        return self._parse(name, lambda raw: tuple(p.strip() for p in raw.split(",") if p.strip()), "list", None)

    def json(self, name: str) -> Any:
        return self._parse(name, json.loads, "JSON value", None)

    def fields(self, cls: type, prefix: str) -> dict[str, Any]:
        """``prefix + FIELD`` for each field of the dataclass ``cls``, parsed by the field's annotated type, as
        keyword arguments for ``cls``. A variable with the prefix that names no field is an error."""
        known = {f.name: str(f.type) for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for var in self.environ:
            if not var.startswith(prefix):
                continue
            name = var[len(prefix) :].lower()
            if name not in known:
                raise self.error(f"unknown variable {var}")
            value = self._by_type(var, known[name])
            if value is not None or known[name].endswith("None"):
                values[name] = value
        return values

    def _by_type(self, var: str, type_name: str) -> Any:
        readers = (("int", self.integer), ("float", self.number), ("bool", self.flag), ("Path", self.path),
                   ("tuple", self.csv))
        for prefix, read in readers:
            if type_name.startswith(prefix):
                return read(var)
        return self.string(var)

    def _parse(self, name: str, cast: Any, expected: str, default: Any) -> Any:
        raw = self.raw(name)
        if raw is None:
            return default
        try:
            return cast(raw)
        except ValueError:
            raise self.error(f"{name}={raw!r} is not a valid {expected}") from None


def _to_bool(raw: str) -> bool:
    lowered = raw.strip().lower()
    if lowered not in _TRUE + _FALSE:
        raise ValueError(raw)
    return lowered in _TRUE
