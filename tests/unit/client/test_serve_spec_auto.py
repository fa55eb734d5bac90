"""``tandem serve --spec auto`` and ``--spec-adaptive``: what make serve runs parses, the
proposer it checks is the MTP head (else the draft given), the engine gets adaptive k."""
from pathlib import Path

import pytest

from tandem.backends.triton.settings import EngineSettings
from tandem.client.paths import DEMO_CHECKPOINTS
from tandem.client.serve.options import ServeOptions

from .test_serve_validation import accepted, draft, refused  # noqa: F401  (draft: a fixture)


def test_make_serve_args_parse_with_the_demo_mtp_head():
    args = accepted(["--spec", "auto"])
    assert args.spec_method == "auto" and args.spec_adaptive == "on"


def test_auto_checks_the_draft_it_is_given(draft, capsys):  # noqa: F811
    assert accepted(["--spec", "auto", "--draft-model", str(draft)]).draft_model == str(draft)
    assert "--draft-vocab-size 500" in refused(["--spec", "auto", "--draft-model", str(draft),
                                                "--draft-vocab-size", "500"], capsys)


def test_spec_adaptive_needs_a_spec(capsys):
    assert refused(["--spec-adaptive", "off"], capsys).startswith(
        "--spec-adaptive 'off': needs --spec draft_target, mtp, ngram or auto")


@pytest.mark.parametrize("given, method, adaptive", [
    ({}, "mtp", True), ({"spec_adaptive": "off"}, "mtp", False)])
def test_the_engine_gets_the_mtp_head_and_adaptive_k(given, method, adaptive):
    values = ServeOptions.of(spec_method="auto", enforce_eager=True, **given).template_values()
    spec = EngineSettings.from_model_config(
        {"parameters": {k: {"string_value": v} for k, v in values.items()}}).speculative()
    assert (spec.method, spec.auto, spec.adaptive) == (method, True, adaptive)
    assert Path(spec.mtp_head).name == "mtp" and spec.draft_model is None


def test_auto_skips_a_default_head_that_does_not_fit_the_target(tmp_path, caplog, capsys):
    """Any Llama-family target starts with --spec auto: the default MTP heads (SmolLM2's,
    hidden 576, vocab 49152; the demo's, hidden 384, vocab 4096) are skipped for another
    model, with a line each that says why, and prompt lookup drafts."""
    import json
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 512, "vocab_size": 32000}))
    assert accepted(["--spec", "auto", "--model", str(tmp_path)]).spec_method == "auto"
    with caplog.at_level("WARNING", logger="tandem.serve"):
        values = ServeOptions.of(model_dir=str(tmp_path), spec_method="auto").template_values()
    assert values["mtp_head"] == "" and values["draft_model"] == ""
    spec = EngineSettings.from_model_config(
        {"parameters": {k: {"string_value": v} for k, v in values.items()}}).speculative()
    assert (spec.method, spec.auto) == ("ngram", True)
    assert "smollm2/mtp does not fit the target (it was trained for hidden 576, vocab 49152; " \
           "the target has hidden 512, vocab 32000)" in caplog.text
    assert "demo/mtp does not fit the target (it was trained for hidden 384, vocab 4096; the " \
           "target has hidden 512, vocab 32000): drafting by prompt lookup only" in caplog.text


@pytest.mark.parametrize("spec_method", ["auto", "mtp"])
def test_a_smollm2_shaped_target_gets_the_smollm2_head(tmp_path, spec_method):
    """The default MTP head is the first that fits: checkpoints/smollm2/mtp for SmolLM2
    (hidden 576, vocab 49152), the demo's for the demo target."""
    import json
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 576, "vocab_size": 49152}))
    assert accepted(["--spec", spec_method, "--model", str(tmp_path)]).spec_method == spec_method
    values = ServeOptions.of(model_dir=str(tmp_path), spec_method=spec_method).template_values()
    assert Path(values["mtp_head"]).parts[-2:] == ("smollm2", "mtp")
    demo = ServeOptions.of(model_dir=str(DEMO_CHECKPOINTS / "target"),
                           spec_method=spec_method).template_values()
    assert Path(demo["mtp_head"]).parts[-2:] == ("demo", "mtp")
