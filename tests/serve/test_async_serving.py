"""One served engine with --async-scheduling (its worker in the "parashift-runner" thread, step
N+1 scheduled while step N runs): openai_api/'s parity and disconnect checks against it, so
its greedy and seeded sampled completions equal the offline engine's one step at a time and a
client that disconnects mid-stream frees its request; and sleep and wake keep its outputs."""

import json

import pytest

from .openai_api.conftest import MODEL, client  # noqa: F401 (client: a fixture)
from .openai_api.test_client_disconnect import (  # noqa: F401 (a test run against this server)
    test_disconnect_frees_the_request,
)
from .openai_api.test_parity import (  # noqa: F401 (a fixture and tests run against this server)
    offline_llm,
    test_greedy_matches_offline_llm,
    test_sampled_completion_matches_offline_llm,
)
from .servers import LONG_ARGS, running_server


@pytest.fixture(scope="module")
def server(tiny_llama_long):
    with running_server(tiny_llama_long, *LONG_ARGS, "--served-model-name", MODEL,
                        "--async-scheduling", "--enable-admin-routes", model_name=MODEL) as s:
        yield s


def test_sleep_and_wake_keep_the_outputs(server):
    def greedy() -> str:
        status, raw = server.request("POST", "/v1/completions", {
            "model": MODEL, "prompt": [5, 17, 42, 99], "max_tokens": 12, "temperature": 0,
            "ignore_eos": True})
        assert status == 200, raw
        return json.loads(raw)["choices"][0]["text"]

    before = greedy()
    status, raw = server.request("POST", "/sleep?level=2", timeout=60)
    assert status == 200, raw
    status, raw = server.request("POST", "/wake_up", timeout=60)
    assert status == 200, raw
    assert greedy() == before
