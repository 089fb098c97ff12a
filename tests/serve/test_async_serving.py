"""One served engine with --async-scheduling (its worker in the "parashift-runner" thread, step
N+1 scheduled while step N runs): test_openai_api's checks against it, so its greedy and
seeded sampled completions equal the offline engine's one step at a time and a client that
disconnects mid-stream frees its request; and sleep and wake keep its outputs."""

import json

import pytest

from .conftest import LONG_ARGS, running_server
from .test_openai_api import (  # noqa: F401 (fixtures and tests that run against this server)
    MODEL,
    client,
    offline_llm,
    test_disconnect_frees_the_request,
    test_greedy_matches_offline_llm,
    test_sampled_completion_matches_offline_llm,
)


@pytest.fixture(scope="module")
def server(tiny_llama_long):
    with running_server(tiny_llama_long, *LONG_ARGS, "--served-model-name", MODEL,
                        "--async-scheduling", model_name=MODEL) as s:
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
