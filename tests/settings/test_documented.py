"""Every setting the code reads is a row of the README's settings tables (Gateway settings, Store settings).

The names come from three places: the gateway's start-up (``GatewayConfig.from_env`` over an environment that
records every name looked up), the dataclasses read by prefix (``EnvReader.fields``: every ``PREFIX + FIELD``), and
the ``REVISIT_...`` names spelled out in the product's code (worker- and launcher-side settings). A row may shorten
a name that shares the row's first name's prefix: ``REVISIT_VIDEO_MAX_SECONDS`` / ``_MAX_FRAMES``."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

import settings
from gateway.config import GatewayConfig
from gateway.config.reuse import RETIRED

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("gateway", "store", "engine_ext", "launcher", "bundled", "settings", "plan", "dashboards")
NAME = re.compile(r"REVISIT_[A-Z0-9_]*[A-Z0-9](?![A-Z0-9_])")  # a prefix (ending in "_") is no setting


class Recording(dict):
    """An environment that records every name looked up in it."""

    def __init__(self, values: dict[str, str]) -> None:
        super().__init__(values)
        self.looked_up: set[str] = set()

    def get(self, key, default=None):
        self.looked_up.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.looked_up.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.looked_up.add(key)
        return super().__contains__(key)


def names_read(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> set[str]:
    by_prefix: list[tuple[type, str]] = []
    fields = settings.EnvReader.fields

    def recording_fields(self, cls, prefix):
        by_prefix.append((cls, prefix))
        return fields(self, cls, prefix)

    monkeypatch.setattr(settings.EnvReader, "fields", recording_fields)
    environ = Recording({"REVISIT_MODEL": "m", "REVISIT_WORKERS": "http://127.0.0.1:1", "REVISIT_AUTH": "open",
                         "REVISIT_STORE_DRAM_DIR": str(tmp_path / "dram"),
                         "REVISIT_STORE_LMDB_DIR": str(tmp_path / "lmdb")})
    GatewayConfig.from_env(environ)
    names = {name for name in environ.looked_up if name.startswith("REVISIT_")}
    assert {prefix for _, prefix in by_prefix} >= {"REVISIT_STORE_", "REVISIT_MATCH_", "REVISIT_VIDEO_"}
    names |= {prefix + field.name.upper() for cls, prefix in by_prefix for field in dataclasses.fields(cls)}
    for package in PRODUCT:
        for path in (ROOT / package).rglob("*.py"):
            names |= set(NAME.findall(path.read_text()))
    return {name for name in names if name not in RETIRED}


def documented(name: str, rows: list[str]) -> bool:
    for row in rows:
        spelled = re.findall(r"`(REVISIT_[A-Z0-9_]+|_[A-Z0-9_]+)`", row.split("|")[1])
        if name in spelled:
            return True
        first = next((s for s in spelled if s.startswith("REVISIT_")), None)
        for short in (s for s in spelled if s.startswith("_")):
            if first and name.endswith(short) and first.startswith(name[: len(name) - len(short)] + "_"):
                return True
    return False


def test_every_setting_read_is_a_row_of_the_readmes_settings_tables(monkeypatch, tmp_path) -> None:
    readme = (ROOT / "README.md").read_text()
    sections = readme.split("\n## ")
    tables = [s for s in sections if s.startswith(("Gateway settings", "Store settings"))]
    assert len(tables) == 2
    rows = [line for section in tables for line in section.splitlines() if line.startswith("| `")]
    names = names_read(monkeypatch, tmp_path)
    assert len(names) > 100  # the gateway's, the store's, the workers' and the launcher's
    missing = sorted(name for name in names if not documented(name, rows))
    assert not missing, f"settings the code reads that the README's tables lack: {missing}"
    # and the other way: no row names a setting nothing reads
    spelled = {name for row in rows for name in re.findall(r"`(REVISIT_[A-Z0-9_]+)`", row.split("|")[1])}
    assert not sorted(spelled - names), f"rows for settings nothing reads: {sorted(spelled - names)}"
