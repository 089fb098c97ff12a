"""The OpenAPI document of the package's server (conftest.py): it describes every endpoint,
the bodies it accepts pass its schema, and what the schema refuses the server refuses."""

from __future__ import annotations

import json

import jsonschema

from .conftest import AUTH, CHAT, COMPLETIONS, MSG
from .test_bad_requests import BAD_REQUESTS


def _validator(doc: dict, name: str) -> jsonschema.Draft202012Validator:
    schema = {"$ref": f"#/components/schemas/{name}", "components": doc["components"]}
    return jsonschema.Draft202012Validator(schema)


GOOD_BODIES = [
    (COMPLETIONS, "CompletionRequest", {"prompt": "hi", "max_tokens": 2}),
    (COMPLETIONS, "CompletionRequest", {"prompt": [[1, 2], [3]], "max_tokens": 1, "n": 2,
                                        "logprobs": 1, "stop": ["x"], "seed": 5}),
    (CHAT, "ChatCompletionRequest", {"messages": MSG, "max_tokens": 2, "stream": True,
                                     "stream_options": {"include_usage": True}}),
]


def test_openapi_describes_every_endpoint_and_the_bodies_it_accepts(server):
    status, raw = server.request("GET", "/openapi.json", headers=AUTH)
    doc = json.loads(raw)
    assert status == 200 and doc["openapi"].startswith("3.1")
    assert set(doc["paths"]) == {"/v1/completions", "/v1/chat/completions", "/v1/models",
                                 "/health", "/metrics", "/reset_prefix_cache", "/openapi.json",
                                 "/sleep", "/wake_up", "/is_sleeping", "/scale",
                                 "/scale_elastic_ep"}
    jsonschema.Draft202012Validator.check_schema(
        {"components": doc["components"], "$ref": "#/components/schemas/CompletionRequest"})
    for path, name, body in GOOD_BODIES:
        _validator(doc, name).validate(body)
        status, raw = server.request("POST", path, body, headers=AUTH)
        assert status == 200, raw
    # What the schema refuses, the server refuses: the bad bodies above that are JSON objects.
    for case_id, path, body, expected, _, _ in BAD_REQUESTS:
        if not isinstance(body, dict) or expected == 404:
            continue
        name = "ChatCompletionRequest" if path == CHAT else "CompletionRequest"
        if not _validator(doc, name).is_valid(body):
            status, raw = server.request("POST", path, body, headers=AUTH)
            assert status == 400, (case_id, raw)
