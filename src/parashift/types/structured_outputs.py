"""A request's output constraint (vLLM's `StructuredOutputsParams`): exactly one of a JSON
schema, any JSON object, a regular expression, a choice among strings, or an EBNF grammar.
The engine compiles it with xgrammar (engine/structured_output.py) and masks every sampled
token to what it allows."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from parashift.types.field_types import check_field_types

MAX_CONSTRAINT_CHARS = 256 * 1024  # a schema, regex or grammar: bounded work to compile
MAX_CHOICES = 1024
TOO_DEEP = "structured_outputs.json is nested too deeply"  # past Python's recursion limit
# JSON schema keywords xgrammar compiles as if they were absent (measured on 0.2.9: an
# instance that breaks them is accepted): refused, so that every output validates. (`oneOf`
# is taken as `anyOf`, as vLLM takes it: its branches' overlap is the schema's own.)
UNENFORCED_KEYWORDS = frozenset({
    "not", "if", "then", "else", "allOf", "uniqueItems", "contains", "minContains",
    "maxContains", "dependentRequired", "dependentSchemas", "dependencies",
    "unevaluatedProperties", "unevaluatedItems", "propertyNames"})
# keywords whose value maps names (not keywords) to schemas
_NAMED_SCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions"})


def check_schema_keywords(schema: Any) -> None:
    """ValueError naming the first keyword of `schema` the grammar would not enforce, or a
    `$ref` outside the schema."""
    _check_keywords(schema, None)


# Where a value sits: (where its parent sits, its key), joined into a path only for an error
# (built at every level, the path would cost time and memory quadratic in the depth).
_At = tuple[Any, str] | None


def _path(at: _At) -> str:
    parts = []
    while at is not None:
        at, key = at
        parts.append(key)
    return "/" + "/".join(reversed(parts))


def _check_keywords(schema: Any, at: _At) -> None:
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            _check_keywords(item, (at, str(i)))
        return
    if not isinstance(schema, dict):
        return
    for key, value in schema.items():
        where = (at, key)
        if key in UNENFORCED_KEYWORDS:
            raise ValueError(f"structured_outputs.json: the keyword {key!r} (at "
                             f"{_path(where)}) is not supported")
        if key == "$ref" and not (isinstance(value, str) and value.startswith("#")):
            raise ValueError(f"structured_outputs.json: $ref {value!r} (at {_path(where)}): "
                             "only references inside the schema are supported")
        if key in _NAMED_SCHEMAS and isinstance(value, dict):
            for name, sub in value.items():
                _check_keywords(sub, (where, name))
        elif key not in ("enum", "const", "required", "examples", "default"):
            _check_keywords(value, where)


@dataclass
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None  # a JSON schema (a dict, or its JSON text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (xgrammar's dialect, as vLLM takes it)
    json_object: bool = False  # any JSON object

    def __post_init__(self) -> None:
        check_field_types(self)
        if isinstance(self.json, dict):
            # (property order is kept: it is the order the object is generated in)
            try:
                self.json = json.dumps(self.json, separators=(",", ":"))
            except RecursionError:
                raise ValueError(TOO_DEEP) from None
        given = [name for name in ("json", "regex", "choice", "grammar")
                 if getattr(self, name) is not None] + (["json_object"] if self.json_object
                                                        else [])
        if len(given) != 1:
            raise ValueError("structured_outputs takes exactly one of json, regex, choice, "
                             f"grammar or json_object, got {', '.join(given) or 'none'}")
        if self.choice is not None and not 1 <= len(self.choice) <= MAX_CHOICES:
            raise ValueError(f"structured_outputs.choice needs 1 to {MAX_CHOICES} strings")
        # A choice's strings count too: they are one grammar's alternatives.
        text = self.choice or [self.json or self.regex or self.grammar or ""]
        if sum(map(len, text)) > MAX_CONSTRAINT_CHARS:
            raise ValueError(f"structured_outputs.{given[0]} has more than "
                             f"{MAX_CONSTRAINT_CHARS} characters")
        if self.json is not None:
            try:
                check_schema_keywords(json.loads(self.json))
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json is not JSON: {e}") from None
            except RecursionError:  # (json's and the keyword check's)
                raise ValueError(TOO_DEEP) from None

    @property
    def kind(self) -> str:
        return next((name for name in ("json", "regex", "choice", "grammar")
                     if getattr(self, name) is not None), "json_object")

    @property
    def key(self) -> tuple[str, str]:
        """What identifies the compiled grammar: the kind and its canonical text."""
        kind = self.kind
        if kind == "choice":
            return kind, json.dumps(self.choice)
        if kind == "json_object":
            return kind, ""
        return kind, str(getattr(self, kind))
