"""Settings of the admin API, /metrics and the cache policy."""

import pytest

from gateway.config import ConfigError, GatewayConfig, PolicySettings

BASE = {"REVISIT_MODEL": "m", "REVISIT_WORKERS": "http://a:1", "REVISIT_AUTH": "open"}


def test_admin_is_disabled_and_metrics_open_by_default():
    config = GatewayConfig.from_env(BASE)
    assert config.admin_token is None and not config.metrics_require_token
    assert config.policy == PolicySettings()


def test_policy_and_admin_settings_from_env():
    config = GatewayConfig.from_env(
        {
            **BASE,
            "REVISIT_ADMIN_TOKEN": "0123456789abcdef",
            "REVISIT_METRICS_REQUIRE_TOKEN": "1",
            "REVISIT_DRAM_CAPACITY_BYTES": "1000",
            "REVISIT_LMDB_CAPACITY_BYTES": "5000",
            "REVISIT_PRESET_FRACTION": "0.25",
            "REVISIT_MAX_PROTECTION_BUDGET": "2",
            "REVISIT_PRESET_REUSE_WEIGHT": "0.5",
            "REVISIT_PRESET_MIN_SCORE": "2",
        }
    )
    assert config.admin_token == "0123456789abcdef" and config.metrics_require_token
    assert config.policy == PolicySettings(
        dram_capacity_bytes=1000, lmdb_capacity_bytes=5000, preset_fraction=0.25, max_protection_budget=2,
        preset_reuse_weight=0.5, preset_min_score=2.0,
    )
    assert (config.policy.preset_capacity_bytes(), config.policy.main_capacity_bytes()) == (250, 750)


@pytest.mark.parametrize(
    "env,message",
    [
        ({"REVISIT_DRAM_CAPACITY_BYTES": "-1"}, "capacities"),
        ({"REVISIT_LMDB_CAPACITY_BYTES": "lots"}, "valid int"),
        ({"REVISIT_PRESET_FRACTION": "1.0"}, "preset_fraction"),
        ({"REVISIT_MAX_PROTECTION_BUDGET": "-2"}, "max_protection_budget"),
        ({"REVISIT_PRESET_REUSE_WEIGHT": "nan"}, "preset_reuse_weight"),
        ({"REVISIT_PRESET_MIN_SCORE": "0"}, "preset_min_score"),
        ({"REVISIT_ADMIN_TOKEN": "short"}, "at least 8"),
        ({"REVISIT_METRICS_REQUIRE_TOKEN": "1"}, "needs an admin_token"),
        ({"REVISIT_METRICS_REQUIRE_TOKEN": "maybe"}, "valid bool"),
    ],
)
def test_bad_settings_fail_loudly(env, message):
    with pytest.raises(ConfigError, match=message):
        GatewayConfig.from_env({**BASE, **env})
