"""SamplingParams and StructuredOutputsParams check their fields' types at construction
(types/field_types.py): a wrong type is a TypeError naming the field, a dict for the
constraint (what vLLM's users write) becomes StructuredOutputsParams, and a choice's strings
fall under the constraint's character cap, and a schema nested past the recursion limit is
a ValueError naming the field."""

from __future__ import annotations

import dataclasses
import tracemalloc

import numpy as np
import pytest

from parashift import SamplingParams, StructuredOutputsParams
from parashift.types.structured_outputs import MAX_CONSTRAINT_CHARS, check_schema_keywords

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def test_a_dict_constraint_becomes_structured_outputs_params():
    params = SamplingParams(structured_outputs={"json": SCHEMA})
    assert params.structured_outputs == StructuredOutputsParams(json=SCHEMA)
    assert SamplingParams(structured_outputs={"choice": ["a", "b"]}).structured_outputs.key == (
        "choice", '["a", "b"]')


@pytest.mark.parametrize("value,error,message", [
    ({"guided_json": SCHEMA}, TypeError, "structured_outputs: unknown field 'guided_json'"),
    ({"json": SCHEMA, "regex": "a"}, ValueError, "exactly one"),
    ({"regex": 5}, TypeError, "StructuredOutputsParams.regex must be str or None, got int"),
    ([SCHEMA], TypeError, "SamplingParams.structured_outputs must be StructuredOutputsParams "
                          "or None, got list"),
    ('{"json": {}}', TypeError, "SamplingParams.structured_outputs must be"),
])
def test_a_bad_constraint_is_refused_naming_the_field(value, error, message):
    with pytest.raises(error, match=message):
        SamplingParams(structured_outputs=value)


@pytest.mark.parametrize("fields,message", [
    ({"json": ["not", "a", "schema"]}, "StructuredOutputsParams.json must be"),
    ({"choice": ["a", 1]}, r"StructuredOutputsParams.choice must be list\[str\] or None, got "
                           r"list\[int \| str\]"),
    ({"choice": "ab"}, "StructuredOutputsParams.choice must be"),
    ({"grammar": b"root ::= 'a'"}, "StructuredOutputsParams.grammar must be"),
    ({"regex": "a", "json_object": 1}, "StructuredOutputsParams.json_object must be bool"),
])
def test_structured_outputs_params_check_their_types(fields, message):
    with pytest.raises(TypeError, match=message):
        StructuredOutputsParams(**fields)


# A value of the wrong type for every field of SamplingParams.
WRONG = {"n": "2", "max_tokens": 16.0, "temperature": "hot", "top_p": None, "top_k": 1.5,
         "min_p": True, "seed": "1", "presence_penalty": [0.1], "frequency_penalty": None,
         "repetition_penalty": "1", "stop": 7, "stop_token_ids": [1, "2"], "ignore_eos": 1,
         "include_stop_str_in_output": "yes", "logprobs": 2.0, "prompt_logprobs": 1,
         "skip_special_tokens": None, "structured_outputs": 3, "cache_salt": 3}


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(SamplingParams)])
def test_every_field_of_the_wrong_type_is_a_type_error_naming_it(name):
    assert name in WRONG, f"SamplingParams.{name} has no wrong value in this test"
    with pytest.raises(TypeError, match=rf"SamplingParams\.{name} must be"):
        SamplingParams(**{name: WRONG[name]})


def test_numbers_of_other_types_are_numbers():
    params = SamplingParams(n=np.int64(2), temperature=1, top_p=np.float32(0.5),
                            seed=np.int32(3), stop="x", cache_salt="tenant-a")
    assert params.n == 2 and params.stop == ["x"] and params.cache_salt == "tenant-a"


def test_a_change_after_construction_is_checked_by_validate():
    params = SamplingParams()
    params.structured_outputs = {"json": SCHEMA}
    with pytest.raises(TypeError, match="structured_outputs"):
        params.validate()


def test_a_choice_falls_under_the_character_cap():
    half = MAX_CONSTRAINT_CHARS // 2
    StructuredOutputsParams(choice=["a" * half, "b" * half])
    with pytest.raises(ValueError, match="choice has more than"):
        StructuredOutputsParams(choice=["a" * half, "b" * half, "c"])


def _nested(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize("schema", [
    _nested(5000),  # past json.dumps's recursion
    "[" * 5000 + "]" * 5000,  # past json.loads's
])
def test_a_schema_nested_too_deeply_is_a_value_error(schema):
    with pytest.raises(ValueError, match="structured_outputs.json is nested too deeply"):
        StructuredOutputsParams(json=schema)


def test_the_keyword_check_builds_its_path_only_for_an_error():
    """Built at every level, 300 levels of 1,000-character names held 90 MB of paths."""
    name = "n" * 1000
    schema: dict = {"type": "integer"}
    for _ in range(300):
        schema = {"type": "object", "properties": {name: schema}}
    tracemalloc.start()
    try:
        check_schema_keywords(schema)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak
    schema["properties"][name]["properties"][name]["items"] = [{}, {"uniqueItems": True}]
    with pytest.raises(ValueError, match=rf"'uniqueItems' \(at /properties/{name}/properties/"
                                         rf"{name}/items/1/uniqueItems\)"):
        check_schema_keywords(schema)
