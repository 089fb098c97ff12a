"""`GET /openapi.json`: the HTTP surface, generated from the request structs the server decodes
with, so that the schema and the validation cannot drift apart."""

from __future__ import annotations

from typing import Any

import msgspec

from parashift.serve.openai_protocol import ChatCompletionRequest, CompletionRequest

_REF = "#/components/schemas/{name}"
_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
_OBJECT = {"type": "object"}


def _response(description: str, schema: dict, content_type: str = "application/json") -> dict:
    return {"description": description, "content": {content_type: {"schema": schema}}}


def _errors(*statuses: int) -> dict[str, dict]:
    why = {400: "invalid request (the field is named in `param`)", 401: "missing or wrong key",
           403: "the API key, where the admin routes take the admin key",
           404: "unknown model", 409: "conflicts with the server's state (the message says)",
           429: "the engines' waiting queues are full",
           503: "no engine can take the request", 504: "the request timed out"}
    return {str(s): _response(why[s], {"$ref": _REF.format(name="Error")}) for s in statuses}


def _generation(summary: str, request: str) -> dict:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": _REF.format(name=request)}}}},
        "responses": {
            "200": {"description": "the completion; with `stream`, server-sent events",
                    "content": {"application/json": {"schema": _OBJECT},
                                "text/event-stream": {"schema": {"type": "string"}}}},
            **_errors(400, 401, 404, 429, 503, 504)}}}


def openapi_document(version: str, admin_routes: bool = False) -> dict[str, Any]:
    """The document of the routes served: the admin routes only where they are on."""
    (completion, chat), components = msgspec.json.schema_components(
        [CompletionRequest, ChatCompletionRequest], ref_template=_REF)
    components["Error"] = _ERROR
    doc = {
        "openapi": "3.1.0",
        "info": {"title": "parashift", "version": version,
                 "description": "OpenAI-compatible completions and chat completions. Request "
                 "fields unknown to both OpenAI and parashift are refused with a 400."},
        "paths": {
            "/v1/completions": _generation("Create a completion", "CompletionRequest"),
            "/v1/chat/completions": _generation("Create a chat completion",
                                                "ChatCompletionRequest"),
            "/v1/models": {"get": {"summary": "The served model", "responses": {
                "200": _response("the model list", _OBJECT), **_errors(401)}}},
            "/health": {"get": {"summary": "Whether every engine is up", "responses": {
                "200": _response("all engines ready", _OBJECT),
                "503": _response("an engine is down or starting", _OBJECT)}}},
            "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {
                "200": _response("text exposition format", {"type": "string"},
                                 "text/plain")}}},
            "/openapi.json": {"get": {"summary": "This document", "responses": {
                "200": _response("OpenAPI 3.1", _OBJECT)}}},
        },
        "components": {"schemas": components},
    }
    if admin_routes:
        doc["paths"].update(_ADMIN_PATHS)
    return doc


# With --admin-api-key (they take that key) or --enable-admin-routes (serve/engine_routes.py).
_ADMIN_PATHS: dict[str, Any] = {
    "/reset_prefix_cache": {"post": {"summary": "Empty every engine's prefix cache",
                                     "responses": {"200": _response("per rank", _OBJECT),
                                                   **_errors(401, 403)}}},
    "/sleep": {"post": {
        "summary": "Every engine drains, then frees its KV cache (level 1) or its weights too "
                   "(level 2)",
        "parameters": [{"name": "level", "in": "query", "schema": {
            "type": "integer", "enum": [1, 2], "default": 1}}],
        "responses": {"200": _response("per rank: level and bytes released", _OBJECT),
                      **_errors(400, 401, 403, 503)}}},
    "/wake_up": {"post": {"summary": "Every engine reloads what it freed",
                          "responses": {"200": _response("per rank", _OBJECT),
                                        **_errors(401, 403)}}},
    "/is_sleeping": {"get": {"summary": "Whether every engine sleeps, and each level",
                             "responses": {"200": _response("per rank", _OBJECT),
                                           **_errors(401, 403)}}},
    **{path: {"post": {
        "summary": f"Serve with {{\"{field}\": N}} data-parallel ranks (up to "
                   "--data-parallel-size-max); answers when N serve",
        "requestBody": {"required": True, "content": {"application/json": {"schema": {
            "type": "object", "required": [field],
            "properties": {field: {"type": "integer", "minimum": 1}}}}}},
        "responses": {"200": _response("the size that serves", _OBJECT),
                      **_errors(400, 401, 403, 409, 503)}}}
       for path, field in (("/scale", "data_parallel_size"),
                           ("/scale_elastic_ep", "new_data_parallel_size"))},
}
