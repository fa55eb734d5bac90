"""``--prefix-caching on|off`` reaches the engine's config (on by default)."""
import argparse

from tandem.backends.triton.settings import EngineSettings


def test_prefix_caching_is_on_by_default_and_can_be_turned_off():
    from tandem.client.serve.flags import add_flags, from_args
    p = argparse.ArgumentParser()
    add_flags(p, EngineSettings)
    on = from_args(EngineSettings, p.parse_args(["--model", "m"]))
    off = from_args(EngineSettings, p.parse_args(["--model", "m", "--prefix-caching", "off"]))
    assert on.engine_kwargs()["enable_prefix_caching"] is True
    assert off.engine_kwargs()["enable_prefix_caching"] is False
    cfg = {"parameters": {"model_dir": {"string_value": "/m"}, "prefix_caching": {"string_value": "off"}}}
    assert EngineSettings.from_model_config(cfg).engine_config().enable_prefix_caching is False
