"""One real `parashift run` started with --api-key (and the admin routes' own key, and one more
allowed Host name) for every module here, which send it bad requests; and the checks they
share: each answer has the right status and OpenAI's error body, and the server stays healthy.
test_admission.py checks its error bodies with them too."""

from __future__ import annotations

import json

import pytest

from ..servers import TINY_ARGS, running_server

API_KEY = "sk-parashift-test"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
ADMIN_KEY = "sk-parashift-admin-test"
ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}
ALLOWED_HOST = "rebind.example"  # --allowed-hosts: served although the bind is loopback
MSG = [{"role": "user", "content": "hi"}]
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="package")  # one server for the package: its modules share it
def server(tiny_llama):
    with running_server(tiny_llama, *TINY_ARGS, "--api-key", API_KEY,
                        "--allowed-hosts", ALLOWED_HOST,
                        env={"PARASHIFT_ADMIN_KEY": ADMIN_KEY}) as s:
        yield s


def assert_openai_error(status: int, raw: bytes, expected_status: int,
                        param: str | None = None, contains: tuple[str, ...] = ()) -> dict:
    assert status == expected_status, raw
    body = json.loads(raw)
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert error["param"] is None or isinstance(error["param"], str)
    assert error["code"] is None or isinstance(error["code"], str)
    if param is not None:
        assert error["param"] == param, error
    for text in contains:
        assert text in error["message"], error
    return error


def assert_healthy(server) -> None:
    status, body = server.get_json("/health")
    assert status == 200 and body["status"] == "ok", body
