"""Random and adversarial requests to every interface of one server (`--mode both`: the
OpenAI API, Triton's HTTP generate endpoint and gRPC streams of each ensemble): each
answer is a success or a clean 4xx, no process dies, and afterwards no request or KV page
is held and the server is ready. ``tandem bench fuzz`` is the same with 10,000 requests."""
from __future__ import annotations

import pytest

from tandem.client.bench.fuzz import FAILED, fuzz, leftovers
from tandem.client.openai.frontend import start_for
from tandem.client.serve.triton_server import free_port

from .servers import served

pytestmark = pytest.mark.e2e
EXAMPLES = 200


def test_fuzzed_requests_get_clean_answers_and_leave_nothing_behind(tmp_path):
    with served(tmp_path, mode="both", max_num_seqs=4) as server:
        api = start_for(server, free_port())
        try:
            tally = fuzz(server, api.base_url, EXAMPLES, 0, timeout_s=120)
        finally:
            api.stop()
        assert tally.total == EXAMPLES
        assert {t.split(":")[0] for t in tally.counts} == {"openai", "grpc", "http", "http-typed"}
        assert not tally.failures, tally.failures[:5]
        assert all(c[FAILED] == 0 for c in tally.counts.values())
        assert leftovers(server) == []
