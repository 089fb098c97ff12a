"""Tool calling over HTTP with the official openai client against `parashift run --strategy
dp2 --enable-auto-tool-choice --tool-call-parser hermes`, on a tiny random-weight model whose
chat template writes the tools and the history's calls: `tool_choice` named and `required`
(constrained: the arguments validate), streamed and not; `auto` read by the hermes parser
(the model's text scripted through a constraint); a history with tool results; the 400s; a
long constrained array streamed to 8 choices while /health answers within 1 s. The server's
--max-request-output-units is checked here too. The plan is unit-tested below on its own,
the readers in test_tool_call_reader.py."""

from __future__ import annotations

import json
import shutil

import jsonschema
import openai
import pytest

from parashift.serve.openai_protocol import ChatCompletionRequest, OpenAIError, parse
from parashift.serve.tool_calls import ToolPlan, tool_plan

from .health_poller import HealthPoller
from .servers import running_server

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
RECORD = {"type": "function", "function": {  # its arguments outlast any max_tokens here
    "name": "record", "parameters": {"type": "object", "properties": {"values": {
        "type": "array", "items": {"type": "integer"}, "minItems": 1000}},
        "required": ["values"]}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
BUDGET = 8000  # --max-request-output-units
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
                        "--tool-call-parser", "hermes", "--max-request-output-units",
                        str(BUDGET), model_name=MODEL) as s:
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


def test_a_long_array_streams_to_8_choices_while_health_answers(client, server):
    """A named tool whose schema asks for 1,000 integers, streamed with n=8 until max_tokens:
    each choice's reader takes only its new text (test_tool_call_reader.py counts the
    characters), and every /health answer the poller measured took under 1 s."""
    calls: dict[int, dict] = {}
    with HealthPoller(server) as poller:
        stream = chat(client, tools=[RECORD], n=8, max_tokens=400, seed=4, stream=True,
                      tool_choice={"type": "function", "function": {"name": "record"}})
        for chunk in stream:
            for choice in chunk.choices:
                call = calls.setdefault(choice.index, {"arguments": "", "pieces": 0})
                for piece in choice.delta.tool_calls or []:
                    if piece.id:
                        assert call["arguments"] == "" and piece.function.name == "record"
                        call["id"] = piece.id
                    elif piece.function and piece.function.arguments:
                        call["arguments"] += piece.function.arguments
                        call["pieces"] += 1
                call["finish"] = choice.finish_reason or call.get("finish")
    poller.assert_responsive(1.0)
    assert sorted(calls) == list(range(8))
    for call in calls.values():
        assert call["id"].startswith("call_") and call["finish"] == "length"
        assert call["arguments"].replace(" ", "").startswith('{"values":[')
        assert call["pieces"] > 100  # piece by piece, as the tokens came


def test_the_flag_sets_the_output_budget(client):
    """--max-request-output-units 8000: 4 x 100 tokens x (1 + 20) is past it; 3 are not."""
    with pytest.raises(openai.BadRequestError, match=r"n=4 .*top_logprobs=20.*8,400.*8,000"):
        chat(client, n=4, max_tokens=100, logprobs=True, top_logprobs=20)
    done = chat(client, n=3, max_tokens=100, logprobs=True, top_logprobs=20,
                extra_body={"ignore_eos": True})
    assert [len(c.logprobs.content) for c in done.choices] == [100] * 3


# --- the plan, on its own ----------------------------------------------------------------------

def _plan(parser=None, **body) -> ToolPlan:
    req = parse(json.dumps({"messages": ASK, **body}).encode(), ChatCompletionRequest)
    return tool_plan(req, parser)


def test_auto_needs_the_servers_parser():
    with pytest.raises(OpenAIError, match="--enable-auto-tool-choice"):
        _plan(tools=[WEATHER], tool_choice="auto")
    assert _plan(tools=[WEATHER]).mode == "none"  # the default without a parser
    assert _plan("hermes", tools=[WEATHER]).mode == "auto"
