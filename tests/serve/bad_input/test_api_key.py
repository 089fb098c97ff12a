"""The API key of the package's server (conftest.py): every route but /health and /metrics
needs it, a missing or wrong key is a 401 (a typed error in the `openai` client), the right one
works, and a key given in the environment stays out of `ps` and the logs."""

from __future__ import annotations

import openai
import pytest

from ..servers import TINY_ARGS, running_server
from .conftest import API_KEY, AUTH, CHAT, COMPLETIONS, MSG, assert_healthy, assert_openai_error


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"},
                                     {"Authorization": API_KEY}],
                         ids=["missing", "wrong", "no-bearer"])
def test_api_key_is_required(server, headers):
    for method, path, body in [("POST", COMPLETIONS, {"prompt": "hi", "max_tokens": 2}),
                               ("POST", CHAT, {"messages": MSG, "max_tokens": 2}),
                               ("GET", "/v1/models", None)]:
        status, raw = server.request(method, path, body, headers=headers)
        error = assert_openai_error(status, raw, 401)
        assert error["code"] == "invalid_api_key"
    assert_healthy(server)


def test_openai_client_with_wrong_key(server):
    with pytest.raises(openai.AuthenticationError) as info:
        server.client(api_key="wrong").completions.create(model=server.model_name, prompt="hi",
                                                          max_tokens=2)
    assert info.value.status_code == 401
    assert_healthy(server)


def test_openai_client_errors_are_typed(server):
    client = server.client(api_key=API_KEY)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=server.model_name, messages=MSG, temperature=-1)
    assert info.value.status_code == 400 and info.value.param == "temperature"
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="nope", messages=MSG, max_tokens=2)
    assert info.value.code == "model_not_found"
    assert_healthy(server)


def test_right_key_works_and_health_needs_none(server):
    client = server.client(api_key=API_KEY)
    r = client.chat.completions.create(model=server.model_name, messages=MSG, max_tokens=3,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    assert [m.id for m in client.models.list().data] == [server.model_name]
    assert server.request("GET", "/health")[0] == 200  # no key needed
    status, raw = server.request("GET", "/metrics")
    assert status == 200 and b"parashift_requests_total" in raw
    assert server.proc.poll() is None  # the launcher never went down


def test_every_route_but_health_and_metrics_needs_the_key(server):
    # (the admin routes take their own key: test_admin_routes.py)
    routes = [("GET", "/openapi.json"), ("GET", "/v1/models")]
    for method, path in routes:
        status, raw = server.request(method, path, headers={"Content-Type": ""})
        assert_openai_error(status, raw, 401)
    for method, path in routes:
        status, raw = server.request(method, path, headers={**AUTH, "Content-Type": ""})
        assert 200 <= status < 300, (path, raw)
    assert_healthy(server)


def test_the_key_from_the_environment_stays_out_of_ps_and_logs(tiny_llama):
    import psutil

    secret = "sk-from-the-environment-7f3a"
    with running_server(tiny_llama, *TINY_ARGS,
                        env={"PARASHIFT_API_KEY": secret}) as s:
        assert s.request("GET", "/v1/models")[0] == 401
        status, _ = s.request("GET", "/v1/models",
                              headers={"Authorization": f"Bearer {secret}"})
        assert status == 200
        tree = [psutil.Process(s.proc.pid), *psutil.Process(s.proc.pid).children(recursive=True)]
        for proc in tree:
            assert secret not in " ".join(proc.cmdline()), proc.name()
    assert secret not in s.output()
