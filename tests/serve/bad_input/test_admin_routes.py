"""The admin routes of the package's server (conftest.py: started with PARASHIFT_ADMIN_KEY) take
the admin key and no other: without a key a 401, with the inference key a 403 (whoever may
generate may not put every engine to sleep), with the admin key they work; the admin key is no
inference key. Without an admin key or --enable-admin-routes they are absent:
tests/serve/test_http_limits.py."""

from __future__ import annotations

import json

from .conftest import ADMIN_AUTH, AUTH, COMPLETIONS, assert_healthy, assert_openai_error

# In this order: the server sleeps for a moment and wakes again (other tests share it).
ADMIN_ROUTES = [("POST", "/reset_prefix_cache"), ("GET", "/is_sleeping"),
                ("POST", "/sleep?level=1"), ("POST", "/wake_up")]
NO_BODY = {"Content-Type": ""}


def test_admin_routes_refuse_the_inference_key_and_take_the_admin_key(server):
    for method, path in ADMIN_ROUTES:
        status, raw = server.request(method, path, headers=NO_BODY)
        assert assert_openai_error(status, raw, 401)["code"] == "invalid_api_key", path
        status, raw = server.request(method, path, headers={**AUTH, **NO_BODY})
        error = assert_openai_error(status, raw, 403, contains=("admin key",))
        assert error["type"] == "permission_error" and error["code"] == "admin_key_required"
    for method, path in ADMIN_ROUTES:
        status, raw = server.request(method, path, headers={**ADMIN_AUTH, **NO_BODY},
                                     timeout=60)
        assert status == 200, (path, raw)
    status, raw = server.request("GET", "/is_sleeping", headers=ADMIN_AUTH)
    assert status == 200 and json.loads(raw)["is_sleeping"] is False, raw
    assert_healthy(server)


def test_the_admin_key_is_no_inference_key(server):
    status, raw = server.request("POST", COMPLETIONS, {"prompt": "hi", "max_tokens": 2},
                                 headers=ADMIN_AUTH)
    assert_openai_error(status, raw, 401)
    status, raw = server.request("POST", COMPLETIONS, {"prompt": "hi", "max_tokens": 2},
                                 headers=AUTH)
    assert status == 200, raw


def test_scale_takes_the_admin_key_and_refuses_what_it_cannot_do(server):
    """A server launched without --data-parallel-size-max keeps its size; bad bodies are
    400s that name the field; nothing changes."""
    for path in ("/scale", "/scale_elastic_ep"):
        status, raw = server.request("POST", path, {"data_parallel_size": 2})
        assert assert_openai_error(status, raw, 401)["code"] == "invalid_api_key", path
        status, raw = server.request("POST", path, {"data_parallel_size": 2}, headers=AUTH)
        assert_openai_error(status, raw, 403, contains=("admin key",))
    status, raw = server.request("POST", "/scale", {"data_parallel_size": 2},
                                 headers=ADMIN_AUTH)
    assert_openai_error(status, raw, 400, contains=("--data-parallel-size-max",))
    for body in ({"data_parallel_size": 0}, {"data_parallel_size": True},
                 {"new_data_parallel_size": 2}, [2], "two"):
        status, raw = server.request("POST", "/scale", body, headers=ADMIN_AUTH)
        assert_openai_error(status, raw, 400, contains=("data_parallel_size",))
    status, raw = server.request("POST", "/scale", b"{not json", headers=ADMIN_AUTH)
    assert_openai_error(status, raw, 400, contains=("not JSON",))
    status, raw = server.request("POST", "/scale", {"data_parallel_size": 1},
                                 headers=ADMIN_AUTH)
    assert status == 200 and json.loads(raw) == {"data_parallel_size": 1}
    assert_healthy(server)
