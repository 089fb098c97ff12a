"""Structured outputs over HTTP, with the official openai client against `parashift run
--strategy dp2` on a tiny random-weight model (a byte-level vocabulary): whatever the model
would say, the constraint holds. `response_format` (json_object, json_schema, the client's
`parse()` with a pydantic model), vLLM's `structured_outputs` (json, regex, choice, grammar),
streamed and not, n > 1 with logprobs; and every bad constraint a 400 naming its field, the
server serving on."""

from __future__ import annotations

import json
import math
import re

import jsonschema
import openai
import pydantic
import pytest

from .conftest import running_server

MODEL = "tiny"
ARGS = ("--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory", "32MiB",
        "--strategy", "dp2", "--served-model-name", MODEL)
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(tiny_llama):
    with running_server(tiny_llama, *ARGS, model_name=MODEL) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def chat(client, **kwargs):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "a person, as JSON"}],
        max_tokens=200, temperature=1.0, **kwargs)


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=6)
    age: int = pydantic.Field(ge=0, le=120)


def test_parse_with_a_pydantic_model(client):
    done = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "a person"}], max_tokens=200,
        response_format=Person, seed=3)
    choice = done.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Person)
    assert 0 <= choice.message.parsed.age <= 120


def test_json_schema_n_samples_all_validate(client):
    done = chat(client, n=4, seed=1, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                               "strict": True}})
    assert len(done.choices) == 4
    for choice in done.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_json_object_and_streamed_json_schema(client):
    # Any object: a random model's strings may run past max_tokens (SmolLM2 closes them:
    # engine/test_structured_outputs.py), but what comes out is an object's start.
    done = chat(client, seed=2, response_format={"type": "json_object"})
    choice = done.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:
        assert choice.finish_reason == "length" and choice.message.content.startswith("{")
    stream = chat(client, seed=5, stream=True, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    text, finish = "", None
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize("constraint,check", [
    ({"regex": r"[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
    ({"choice": ["yes", "no", 'say "hi"\\n']}, lambda t: t in ("yes", "no", 'say "hi"\\n')),
    ({"grammar": 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9]'},
     lambda t: re.fullmatch(r"\([1-9](\+[1-9])*\)", t)),
    ({"json": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
])
def test_vllms_structured_outputs_field_on_completions(client, constraint, check):
    for seed in range(3):
        done = client.completions.create(model=MODEL, prompt="x", max_tokens=120, seed=seed,
                                         temperature=1.0,
                                         extra_body={"structured_outputs": constraint})
        choice = done.choices[0]
        assert choice.finish_reason == "stop" and check(choice.text), choice


def test_logprobs_are_of_the_masked_distribution(client):
    done = client.completions.create(model=MODEL, prompt="x", max_tokens=8, temperature=1.0,
                                     logprobs=5, extra_body={"structured_outputs": {
                                         "choice": ["ab", "cd"]}})
    choice = done.choices[0]
    assert choice.text in ("ab", "cd")
    first = choice.logprobs.top_logprobs[0]
    # Only "a" and "c" may start an answer: the masked tokens have no probability left.
    finite = {token: lp for token, lp in first.items() if lp is not None and math.isfinite(lp)}
    assert set(finite) <= {"a", "c"} and finite, first
    assert math.isclose(sum(math.exp(lp) for lp in finite.values()), 1.0, rel_tol=1e-3)


@pytest.mark.parametrize("body,param,message", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}, "response_format", "json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, "response_format", "'uniqueItems'"),
    ({"structured_outputs": {"json": {"$ref": "https://example.com/s.json"}}},
     "structured_outputs", "only references inside the schema"),
    ({"response_format": {"type": "yaml"}}, "response_format", "type"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "regex"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs",
     "grammar"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "exactly one"),
    ({"structured_outputs": {"json": "[1, 2]"}}, "structured_outputs", "JSON schema object"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     "structured_outputs", "not both"),
])
def test_a_bad_constraint_is_a_400_naming_its_field(server, body, param, message):
    status, raw = server.request("POST", "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], **body})
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == param and message in error["message"], raw
    assert server.get_json("/health")[0] == 200


def test_the_openapi_document_describes_the_constraints(server):
    status, doc = server.get_json("/openapi.json")
    schemas = doc["components"]["schemas"]
    assert status == 200 and "ResponseFormat" in schemas
    assert set(schemas["StructuredOutputsRequest"]["properties"]) == {
        "json", "regex", "choice", "grammar", "json_object"}


def test_openai_client_sees_the_400(client):
    with pytest.raises(openai.BadRequestError, match="regex"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=4,
                                  extra_body={"structured_outputs": {"regex": "["}})
