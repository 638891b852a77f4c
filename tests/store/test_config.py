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
        {"REVISIT_STORE_TIERS": "dram,mooncake"},  # the shared tier needs its master
        {"REVISIT_STORE_TIERS": "mooncake", "REVISIT_STORE_MOONCAKE_MASTER": "no-port"},
        {"REVISIT_STORE_TIERS": "mooncake", "REVISIT_STORE_MOONCAKE_MASTER": "m:1",
         "REVISIT_STORE_MOONCAKE_PROTOCOL": "x"},
    ],
)
def test_bad_values_fail_loudly(env):
    with pytest.raises(ConfigError):
        StoreConfig.from_env(env)


def test_the_mooncake_tier_defaults_to_its_masters_endpoints():
    config = StoreConfig.from_env({"REVISIT_STORE_TIERS": "mooncake", "REVISIT_STORE_MOONCAKE_MASTER": "mc.lan:50051"})
    assert config.tiers == ("mooncake",)
    assert config.mooncake_metadata_url == "http://mc.lan:8080/metadata"
    assert config.mooncake_admin == "http://mc.lan:9003"
    explicit = StoreConfig(tiers=("mooncake",), mooncake_master="mc.lan:50051", mooncake_admin_url="http://a:1",
                           mooncake_metadata_server="http://b:2/metadata")
    assert (explicit.mooncake_admin, explicit.mooncake_metadata_url) == ("http://a:1", "http://b:2/metadata")


def test_an_unreachable_mooncake_master_fails_at_once(tmp_path):
    from store import StoreError, open_store
    from tests.conftest import free_port

    config = StoreConfig(tiers=("mooncake",), mooncake_master=f"127.0.0.1:{free_port()}")
    with pytest.raises(StoreError, match="not reachable"):
        open_store(config)
