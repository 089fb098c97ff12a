"""Structured outputs over HTTP, with the official openai client against `parashift run
--strategy dp2` on a tiny random-weight model (a byte-level vocabulary): whatever the model
would say, the constraint holds. `response_format` (json_object, json_schema, the client's
`parse()` with a pydantic model), vLLM's `structured_outputs` (json, regex, choice, grammar),
streamed and not, n > 1 with logprobs; every bad constraint a 400 naming its field, the
server serving on; a schema that would compile for minutes refused within
--grammar-compile-timeout, its compile process killed, other constraints compiling beside it
and after it in under a second; and the API server's memory bounded after 1,000 distinct
failing regexes. Without a server (serve/request_params.py): a schema nested past the
recursion limit is a 400 naming its field, and the compile check is a 429 with Retry-After
while too many compiles wait and a 503, never a hang, when the compile process does not
answer."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math
import re
import threading
import time

import jsonschema
import openai
import psutil
import pydantic
import pytest

from parashift import StructuredOutputsParams
from parashift.engine.grammar_process import CompileResult
from parashift.engine.structured_output import CompilesBusy
from parashift.serve.openai_protocol import (
    CompletionRequest,
    JsonSchemaFormat,
    OpenAIError,
    ResponseFormat,
    StructuredOutputsRequest,
)
from parashift.serve.overload import RetryLaterError
from parashift.serve.request_params import check_compiles, structured_outputs

from .servers import live, running_server, wait_gone

MODEL = "tiny"
COMPILE_TIMEOUT_S = 4.0  # the API server's check (the engines keep their own 30 s)
ARGS = ("--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory", "32MiB",
        "--strategy", "dp2", "--served-model-name", MODEL,
        "--grammar-compile-timeout", str(COMPILE_TIMEOUT_S))
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


def _process(procs: list[psutil.Process], name: str) -> psutil.Process | None:
    for p in live(procs):
        try:
            if name in " ".join(p.cmdline()):
                return p
        except psutil.Error:
            pass
    return None


def _wait_for(find, timeout: float = 60.0):
    """find()'s first answer that is not None."""
    deadline = time.monotonic() + timeout
    while (found := find()) is None:
        assert time.monotonic() < deadline, "not there in time"
        time.sleep(0.02)
    return found


def _object_schema(*names: str) -> dict:
    return {"type": "object", "properties": {n: {"type": "string"} for n in names}}


def _timed_constrained(server, schema: dict, rank: int | None = None) -> tuple[float, int]:
    start = time.monotonic()
    status, raw = server.request("POST", "/v1/completions", {
        "model": MODEL, "prompt": "x", "max_tokens": 1,
        "structured_outputs": {"json": schema}},
        headers={} if rank is None else {"X-data-parallel-rank": str(rank)}, timeout=120)
    assert status == 200, raw
    return time.monotonic() - start, status


def test_a_schema_that_would_compile_for_minutes_is_stopped(server):
    for rank in (0, 1):  # every compile process started (the first start takes seconds)
        _timed_constrained(server, _object_schema(f"warm{rank}"), rank)
    api = _process(server.current_tree(), "parashift-api-0")
    warm = _process(api.children(), "parashift-grammar-api0")
    assert warm is not None, api.children()
    # N optional string properties: ~19 s at 1,600 here, ~9x per doubling.
    slow = _object_schema(*(f"p{i}" for i in range(3200)))
    answer: list = []
    start = time.monotonic()
    sender = threading.Thread(target=lambda: answer.append(server.request(
        "POST", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 4,
                                    "structured_outputs": {"json": slow}}, timeout=120)))
    sender.start()
    compile_ = _wait_for(lambda: _process(warm.children(), "parashift-grammar-api0-compile"))
    beside, _ = _timed_constrained(server, _object_schema("beside"))
    sender.join(120)
    elapsed = time.monotonic() - start
    status, raw = answer[0]
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == "structured_outputs", raw
    assert f"did not compile within {COMPILE_TIMEOUT_S:g} s" in error["message"]
    assert elapsed < COMPILE_TIMEOUT_S + 1.5, elapsed
    assert not wait_gone([compile_], 0), "the stopped compile's process is still there"
    after, _ = _timed_constrained(server, _object_schema("after"))
    assert beside < 1.0 and after < 1.0, (beside, after)
    assert server.get_json("/health")[0] == 200


def test_memory_stays_bounded_after_1000_failing_regexes(server):
    api = _process(server.current_tree(), "parashift-api-0")

    def refused(i: int) -> None:
        # 64 KiB each: kept as cache keys, 1,000 of them would be 64 MiB
        regex = f"({i}" + "a" * (64 << 10)
        status, raw = server.request("POST", "/v1/completions", {
            "model": MODEL, "prompt": "x", "max_tokens": 4,
            "structured_outputs": {"regex": regex}}, timeout=120)
        assert status == 400 and b"regex" in raw, raw

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(refused, range(100)))  # allocator and caches warm
        before = api.memory_info().rss
        list(pool.map(refused, range(100, 1100)))
    grown = api.memory_info().rss - before
    assert grown < 24 << 20, f"the API server grew by {grown >> 20} MiB"
    assert server.get_json("/health")[0] == 200


def _deep_schema(depth: int) -> dict:
    schema: dict = {}
    for _ in range(depth):
        schema = {"items": schema}
    return schema


@pytest.mark.parametrize("constraint,param", [
    ({"structured_outputs": StructuredOutputsRequest(json="[" * 5000 + "]" * 5000)},
     "structured_outputs"),
    ({"structured_outputs": StructuredOutputsRequest(json='{"items":' * 5000 + "}" * 5000)},
     "structured_outputs"),
    # (a body this deep is refused by its decode; one decoded deeper in the stack is not)
    ({"response_format": ResponseFormat("json_schema", JsonSchemaFormat(
        "x", schema_=_deep_schema(5000)))}, "response_format"),
])
def test_a_schema_nested_too_deeply_is_a_400_naming_its_field(constraint, param):
    req = CompletionRequest(model=MODEL, prompt="x", **constraint)
    with pytest.raises(OpenAIError) as refused:
        structured_outputs(req)
    assert refused.value.status == 400 and refused.value.param == param
    assert "nested too deeply" in refused.value.message


class FakeGrammars:
    """Grammars.compile's answers, chosen by the test."""

    def __init__(self, answer: concurrent.futures.Future | Exception, max_wait_s: float = 5.0):
        self.answer = answer
        self.max_wait_s = max_wait_s

    def compile(self, params: StructuredOutputsParams) -> concurrent.futures.Future:
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def _check(grammars: FakeGrammars) -> OpenAIError:
    with pytest.raises(OpenAIError) as refused:
        asyncio.run(check_compiles(grammars, StructuredOutputsParams(regex="a"),  # type: ignore[arg-type]
                                   "structured_outputs"))
    return refused.value


def test_too_many_compiles_waiting_is_a_429_with_retry_after():
    refused = _check(FakeGrammars(CompilesBusy("12 constraints are compiling", 7.5)))
    assert isinstance(refused, RetryLaterError) and refused.status == 429
    assert refused.retry_after == 7.5 and "compiling" in refused.message


def test_a_constraint_that_fails_is_a_400_and_one_never_answered_a_503():
    failed: concurrent.futures.Future = concurrent.futures.Future()
    failed.set_result(CompileResult(error="structured_outputs.regex: unclosed"))
    refused = _check(FakeGrammars(failed))
    assert (refused.status, refused.param) == (400, "structured_outputs")
    # A compile process hung at its start: the request ends at the bound, not never.
    never: concurrent.futures.Future = concurrent.futures.Future()
    never.set_running_or_notify_cancel()
    refused = _check(FakeGrammars(never, max_wait_s=0.05))
    assert refused.status == 503 and "does not answer" in refused.message
    assert not never.done()  # still there for the others that share it
