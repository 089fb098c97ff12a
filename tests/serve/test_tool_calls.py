"""Tool calling over HTTP with the official openai client against `parashift run --strategy
dp2 --enable-auto-tool-choice --tool-call-parser hermes`, on a tiny random-weight model whose
chat template writes the tools and the history's calls: `tool_choice` named and `required`
(constrained: the arguments validate), streamed and not; `auto` read by the hermes parser
(the model's text scripted through a constraint); a history with tool results; the 400s.
The parsers and the plan are unit-tested below on their own."""

from __future__ import annotations

import json
import shutil

import jsonschema
import openai
import pytest

from parashift.serve.openai_protocol import ChatCompletionRequest, OpenAIError, parse
from parashift.serve.tool_calls import ToolCallReader, ToolPlan, tool_plan

from .conftest import running_server

MODEL = "tiny-tools"
TEMPLATE = (
    "{% if tools %}<|tools|>{{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{{ {'name': c['function']['name'], "
    "'arguments': c['function']['arguments']} | tojson }}</tool_call>{% endfor %}"
    "{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "integer", "minimum": -12, "maximum": 12}}, "required": ["zone"]}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "weather in Paris?"}]


@pytest.fixture(scope="module")
def tool_model(tiny_llama, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tools") / "model"
    shutil.copytree(tiny_llama, folder)
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    return str(folder)


@pytest.fixture(scope="module")
def server(tool_model):
    with running_server(tool_model, "--dtype", "float32", "--max-model-len", "1024",
                        "--kv-cache-memory", "32MiB", "--strategy", "dp2",
                        "--served-model-name", MODEL, "--enable-auto-tool-choice",
                        "--tool-call-parser", "hermes", model_name=MODEL) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def chat(client, messages=ASK, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=messages, **{
        "max_tokens": 300, "temperature": 1.0, **kwargs})


def test_a_named_function_gives_its_arguments(client):
    done = chat(client, tools=[WEATHER, TIME], seed=1, tool_choice={
        "type": "function", "function": {"name": "get_time"}})
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_time"])


@pytest.mark.parametrize("parallel", [False, True])
def test_required_calls_validate(client, parallel):
    done = chat(client, tools=[WEATHER, TIME], seed=2, n=3, tool_choice="required",
                parallel_tool_calls=parallel)
    for choice in done.choices:
        # in parallel a random model may add calls until max_tokens: the complete ones count
        assert choice.finish_reason == "tool_calls" or parallel, choice
        calls = choice.message.tool_calls
        assert calls and (parallel or len(calls) == 1)
        assert len({c.id for c in calls}) == len(calls)
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments),
                                SCHEMAS[call.function.name])


def _streamed_calls(stream) -> tuple[str, dict[int, dict], str | None]:
    """(content, calls by index: id, name, arguments, and the chunk order seen), finish."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for piece in choice.delta.tool_calls or []:
                call = calls.setdefault(piece.index, {"arguments": "", "events": []})
                if piece.id:
                    assert "id" not in call and call["arguments"] == ""  # id and name first
                    call.update(id=piece.id, name=piece.function.name)
                    call["events"].append("name")
                if piece.function and piece.function.arguments:
                    assert "id" in call
                    call["arguments"] += piece.function.arguments
                    call["events"].append("arguments")
            finish = choice.finish_reason or finish
    return content, calls, finish


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {
    "name": "get_weather"}}])
def test_streamed_calls_send_the_name_then_the_arguments_in_pieces(client, tool_choice):
    content, calls, finish = _streamed_calls(chat(client, tools=[WEATHER, TIME], seed=3,
                                                  stream=True, tool_choice=tool_choice))
    assert finish == "tool_calls" and content == "" and calls
    for call in calls.values():
        assert call["events"][0] == "name" and call["events"].count("arguments") > 1
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


SCRIPTED = ('Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris", '
            '"unit": "c"}}</tool_call>')


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_the_models_own_calls_with_the_hermes_parser(client, stream):
    """The model's text is scripted through a choice constraint: the parser reads it."""
    kwargs = dict(tools=[WEATHER, TIME], tool_choice="auto",
                  extra_body={"structured_outputs": {"choice": [SCRIPTED]}})
    if not stream:
        choice = chat(client, **kwargs).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure."
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "c"}
        return
    content, calls, finish = _streamed_calls(chat(client, stream=True, **kwargs))
    assert finish == "tool_calls" and content.strip() == "Sure."
    assert [c["name"] for c in calls.values()] == ["get_weather"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "unit": "c"}


def test_plain_text_under_auto_is_content(client):
    choice = chat(client, tools=[WEATHER], max_tokens=20, extra_body={
        "structured_outputs": {"choice": ["It is sunny."]}}).choices[0]
    assert choice.message.content == "It is sunny." and not choice.message.tool_calls
    assert choice.finish_reason == "stop"


def test_a_history_with_tool_results_is_rendered(client, tool_model):
    from transformers import AutoTokenizer

    history = [*ASK,
               {"role": "assistant", "content": None, "tool_calls": [{
                   "id": "call_1", "type": "function", "function": {
                       "name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
               {"role": "user", "content": "and in Rome?"}]
    done = chat(client, history, tools=[WEATHER], max_tokens=4, tool_choice="none")
    rendered = AutoTokenizer.from_pretrained(tool_model).apply_chat_template(
        [{**m, "content": m["content"] or ""} | ({"tool_calls": [{
            "id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}]}
            if m.get("tool_calls") else {}) for m in history],
        tools=[{"type": "function", "function": {**WEATHER["function"]}}],
        add_generation_prompt=True, tokenize=True)
    ids = rendered["input_ids"] if hasattr(rendered, "keys") else rendered
    # the template saw the tools and the call's arguments as an object
    assert done.usage.prompt_tokens == len(ids)
    assert done.choices[0].message.tool_calls is None


@pytest.mark.parametrize("body,message", [
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "not among the tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "array"}}}]}, 'type "object"'),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "not": {"required": ["a"]}}}}], "tool_choice": "required"}, "'not'"),
    ({"tools": [WEATHER, WEATHER]}, "a second function"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {
        "type": "json_object"}}, "constrains the reply"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "tool_call_id"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{
        "id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "not JSON"),
])
def test_bad_tools_are_a_400(server, body, message):
    status, raw = server.request("POST", "/v1/chat/completions",
                                 {"model": MODEL, "messages": ASK, **body})
    assert status == 400 and message in json.loads(raw)["error"]["message"], raw
    assert server.get_json("/health")[0] == 200


def test_the_client_raises_on_a_400(client):
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        chat(client, tool_choice="required")


# --- the plan and the parsers, on their own ----------------------------------------------------

def _plan(parser=None, **body) -> ToolPlan:
    req = parse(json.dumps({"messages": ASK, **body}).encode(), ChatCompletionRequest)
    return tool_plan(req, parser)


def test_auto_needs_the_servers_parser():
    with pytest.raises(OpenAIError, match="--enable-auto-tool-choice"):
        _plan(tools=[WEATHER], tool_choice="auto")
    assert _plan(tools=[WEATHER]).mode == "none"  # the default without a parser
    assert _plan("hermes", tools=[WEATHER]).mode == "auto"


def _read(parser: str, text: str, final: bool = True):
    content, calls = ToolCallReader(ToolPlan("auto", parser=parser)).read(text, final)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def test_hermes_holds_back_what_may_open_a_call():
    assert _read("hermes", "Hi <tool_c", final=False) == ("Hi ", [])
    assert _read("hermes", "Hi <tool_c") == ("Hi <tool_c", [])
    assert _read("hermes", 'a<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>b'
                           '<tool_call>{"name": "g", "arguments": {}}</tool_call>') == (
        "ab", [("f", {"x": 1}), ("g", {})])
    assert _read("hermes", "<tool_call>not json</tool_call>") == (
        "<tool_call>not json</tool_call>", [])


def test_llama3_json_and_mistral():
    assert _read("llama3_json", '{"name": "f", "parameters": {"a": 2}}; '
                                '{"name": "g", "parameters": {}}') == (
        "", [("f", {"a": 2}), ("g", {})])
    assert _read("llama3_json", '{"name": "f", "par', final=False) == ("", [])
    assert _read("llama3_json", "plain text") == ("plain text", [])
    assert _read("mistral", 'ok [TOOL_CALLS][{"name": "f", "arguments": {"q": "a]"}}]') == (
        "ok ", [("f", {"q": "a]"})])
    assert _read("mistral", "[TOOL_CALLS][{", final=False) == ("", [])


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def test_a_named_call_is_complete_once_its_object_closes():
    reader = ToolCallReader(ToolPlan("named", name="f"))
    assert not reader.read('{"a": 1', final=True)[1][0].complete  # cut by max_tokens
    assert reader.read('{"a": "}"}', final=True)[1][0].complete


def test_the_required_form_is_read_as_it_grows():
    reader = ToolCallReader(ToolPlan("required"))
    text = '[{"name": "f", "parameters": {"s": "}{"}}, {"name": "g", "parameters": {}}]'
    seen = []
    for end in range(len(text) + 1):
        _, calls = reader.read(text[:end], end == len(text))
        assert all(c.complete == _parses(c.arguments) for c in calls)
        seen.append([(c.name, c.arguments, c.complete) for c in calls])
    assert seen[-1] == [("f", '{"s": "}{"}', True), ("g", "{}", True)]
    # every step only extends what came before: a stream never takes anything back
    for before, after in zip(seen, seen[1:], strict=False):
        for (n0, a0, _), (n1, a1, _) in zip(before, after, strict=False):
            assert n0 == n1 and a1.startswith(a0)
