"""AIPerf (NVIDIA's successor to genai-perf, ``aiperf`` 0.13, unchanged, from its own venv
that ``make test`` installs) profiles the OpenAI API: streaming chat with synthetic prompts
at concurrency 2, with the API key it must send. Its JSON export must count every request
completed and no error."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tandem.client.openai.frontend import start_for
from tandem.client.serve.triton_server import free_port

pytestmark = pytest.mark.e2e

AIPERF = Path(__file__).resolve().parents[2] / ".venv-aiperf" / "bin" / "aiperf"
REQUESTS = 12
KEY = "sk-tandem-aiperf"


@pytest.fixture(scope="module")
def api(serve):
    with serve("aiperf", max_num_seqs=4) as server:
        frontend = start_for(server, free_port(), api_key=KEY)
        try:
            yield frontend
        finally:
            frontend.stop()


def test_aiperf_profiles_streaming_chat_with_no_error(api, demo_checkpoint, tmp_path):
    assert AIPERF.exists(), f"{AIPERF} is missing: `make test` installs it (the Makefile's .venv-aiperf)"
    out = tmp_path / "aiperf"
    cmd = [str(AIPERF), "profile", "--model", "tandem", "--url", api.base_url.removesuffix("/v1"),
           "--endpoint-type", "chat", "--streaming", "--api-key", KEY,
           "--request-count", str(REQUESTS), "--concurrency", "2", "--tokenizer", str(demo_checkpoint),
           "--synthetic-input-tokens-mean", "64", "--synthetic-input-tokens-stddev", "0",
           "--output-tokens-mean", "16", "--random-seed", "1", "--no-auto-plot",
           "--output-artifact-dir", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    export = json.loads((out / "profile_export_aiperf.json").read_text())
    assert export["request_count"]["avg"] == REQUESTS, export["request_count"]
    assert export["error_summary"] == [] and not export["was_cancelled"], export["error_summary"]
    assert export["time_to_first_token"]["avg"] > 0 and export["output_token_count"]["avg"] > 0
