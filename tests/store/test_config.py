"""StoreConfig: defaults, REVISIT_STORE_* variables, loud failure on bad values."""

from __future__ import annotations

from pathlib import Path

import pytest

from store import ConfigError, StoreConfig


def test_defaults_name_the_directories():
    config = StoreConfig(name="alpha")
    assert config.dram_path == Path("/dev/shm/revisit-store-alpha")
    assert config.lmdb_path.name == "store-alpha"
    assert config.tiers == ("dram", "lmdb")


def test_from_env_reads_prefixed_variables():
    config = StoreConfig.from_env({
        "REVISIT_STORE_NAME": "beta",
        "REVISIT_STORE_TIERS": "lmdb",
        "REVISIT_STORE_DRAM_DIR": "/tmp/d",
        "REVISIT_STORE_LMDB_MAP_SIZE": "1048576",
        "REVISIT_STORE_LMDB_GROWTH_FACTOR": "1.5",
        "REVISIT_STORE_PIN_HOST_MEMORY": "false",
        "REVISIT_MODEL": "ignored: not the store's prefix",
    })
    assert (config.name, config.tiers, config.dram_path) == ("beta", ("lmdb",), Path("/tmp/d"))
    assert config.lmdb_map_size == 1 << 20 and config.lmdb_growth_factor == 1.5 and not config.pin_host_memory


@pytest.mark.parametrize(
    "env",
    [
        {"REVISIT_STORE_LMDB_MAP_SIZE": "big"},
        {"REVISIT_STORE_PIN_HOST_MEMORY": "maybe"},
        {"REVISIT_STORE_TIERS": "dram,gpu"},
        {"REVISIT_STORE_TIERS": "dram,dram"},
        {"REVISIT_STORE_NAME": "../escape"},
        {"REVISIT_STORE_UNKNOWN": "1"},
        {"REVISIT_STORE_LMDB_MAP_SIZE": "0"},
        {"REVISIT_STORE_LMDB_GROWTH_FACTOR": "1"},
        {"REVISIT_STORE_DRAM_LIMIT_BYTES": "-1"},
        {"REVISIT_STORE_LMDB_MAX_READERS": "0"},
    ],
)
def test_bad_values_fail_loudly(env):
    with pytest.raises(ConfigError):
        StoreConfig.from_env(env)
