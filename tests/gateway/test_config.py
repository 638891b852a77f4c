import json

import pytest

from gateway.config import ConfigError, GatewayConfig, ProcessorSettings, TenantSettings


def test_from_env_reads_prefixed_variables(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps({"patch_size": 16, "merge_size": 2, "min_pixels": 1024, "max_pixels": 65536})
    )
    config = GatewayConfig.from_env(
        {
            "REVISIT_MODEL": "m",
            "REVISIT_WORKERS": "http://a:1/, http://b:2",
            "REVISIT_MODEL_DIR": str(tmp_path),
            "REVISIT_AUTH": "open",
            "REVISIT_NAMESPACES": '{"k1": "team"}',
            "REVISIT_ALLOW_PRIVATE_IMAGE_URLS": "1",
            "REVISIT_MAX_IMAGES_PER_REQUEST": "3",
            "REVISIT_HEALTH_TIMEOUT_S": "2.5",
            "REVISIT_MATCH_MAX_SUBTOKEN_PX_Y": "7",
            "REVISIT_MATCH_MAX_SUBTOKEN_PX_X": "0",
        }
    )
    assert config.workers == ("http://a:1", "http://b:2")
    assert config.processor == ProcessorSettings(patch_size=16, merge_size=2, min_pixels=1024, max_pixels=65536)
    assert config.tenants == TenantSettings.open({"k1": "team"})
    assert config.images.allow_private_urls and config.images.max_images_per_request == 3
    assert config.health_timeout_s == 2.5
    match = config.reuse.match
    assert (match.max_subtoken_px_y, match.max_subtoken_px_x) == (7, 0)
    assert match.plans_offset((-7, 0)) and not match.plans_offset((-8, 0)) and not match.plans_offset((0, 1))


@pytest.mark.parametrize(
    "env,message",
    [
        ({"REVISIT_WORKERS": "http://a:1"}, "REVISIT_MODEL"),
        ({"REVISIT_MODEL": "m", "REVISIT_WORKERS": "a:1"}, "http://"),
        ({"REVISIT_MODEL": "m", "REVISIT_WORKERS": "http://a:1", "REVISIT_MAX_IMAGE_BYTES": "lots"}, "valid int"),
        ({"REVISIT_MODEL": "m", "REVISIT_WORKERS": "http://a:1", "REVISIT_NAMESPACES": "[1]"}, "JSON object"),
        ({"REVISIT_MODEL": "m", "REVISIT_WORKERS": "http://a:1,http://a:1"}, "distinct"),
        # renamed settings name their new names rather than being ignored
        ({"REVISIT_MODEL": "m", "REVISIT_WORKERS": "http://a:1", "REVISIT_MATCH_STRATEGY": "vlcache"},
         "REVISIT_MATCH_SELECTOR"),
        ({"REVISIT_MODEL": "m", "REVISIT_WORKERS": "http://a:1", "REVISIT_MATCH_ALLOW_STRATEGY_HEADER": "1"},
         "REVISIT_MATCH_ALLOW_SELECTOR_HEADER"),
        ({"REVISIT_MODEL": "m", "REVISIT_WORKERS": "http://a:1", "REVISIT_MATCH_SELECTOR": "magic"}, "selector"),
        # one bound for both axes became one per axis: the old name says so
        ({"REVISIT_MODEL": "m", "REVISIT_WORKERS": "http://a:1", "REVISIT_MATCH_MAX_SUBTOKEN_PX": "2"},
         "REVISIT_MATCH_MAX_SUBTOKEN_PX_Y"),
        ({"REVISIT_MODEL": "m", "REVISIT_WORKERS": "http://a:1", "REVISIT_MATCH_MAX_SUBTOKEN_PX_X": "15"},
         r"max_subtoken_px_x must be in \[0, 13\]"),
    ],
)
def test_bad_settings_fail_loudly(env, message):
    with pytest.raises(ConfigError, match=message):
        GatewayConfig.from_env(env)


def test_processor_settings_from_the_bundled_model(model_path):
    settings = ProcessorSettings.from_model_dir(model_path)
    assert settings.factor == 28 and settings.max_pixels >= settings.min_pixels


def test_model_dir_without_processor_settings(tmp_path):
    with pytest.raises(ConfigError, match="no image processor settings"):
        ProcessorSettings.from_model_dir(tmp_path)
