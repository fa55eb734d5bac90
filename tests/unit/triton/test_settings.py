"""Engine settings from a model's config.pbtxt parameters (backends/triton/settings.py)."""

from __future__ import annotations

import pytest

from tandem.backends.triton.settings import EngineSettings, model_limits

from .fakes import CONTEXT, VOCAB
from .model_calls import model_config


def test_settings_from_config(ckpt_dir):
    s = EngineSettings.from_model_config(model_config(page_size=32, kv_layout="NHD", num_pages=0))
    assert (s.page_size, s.kv_layout, s.engine_num_pages, s.threads) == (32, "NHD", None, 1)
    unrendered = EngineSettings.from_model_config(model_config(dtype="${dtype}"))
    assert unrendered.dtype == "float32"
    with pytest.raises(ValueError, match="kv_layout='XYZ'; allowed: HND, NHD"):
        EngineSettings.from_model_config(model_config(kv_layout="XYZ"))
    with pytest.raises(ValueError, match="page_size='big' is not an integer"):
        EngineSettings.from_model_config(model_config(page_size="big"))
    with pytest.raises(ValueError, match="model_dir is required"):
        EngineSettings.from_model_config({"parameters": {}})
    assert model_limits(ckpt_dir) == (VOCAB, CONTEXT)


def test_speculation_settings_reach_the_engine():
    cfg = {"parameters": {"model_dir": {"string_value": "/m"},
                          "spec_method": {"string_value": "mtp"},
                          "num_speculative_tokens": {"string_value": "2"},
                          "mtp_head": {"string_value": "/heads/mtp"}}}
    spec = EngineSettings.from_model_config(cfg).engine_kwargs()["speculative"]
    assert (spec.method, spec.num_speculative_tokens, spec.mtp_head) == ("mtp", 2, "/heads/mtp")
    cfg["parameters"]["mtp_head"] = {"string_value": ""}
    with pytest.raises(ValueError, match="mtp_head"):
        EngineSettings.from_model_config(cfg)
