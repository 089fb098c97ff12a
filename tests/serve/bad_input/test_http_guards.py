"""What the package's server (conftest.py) refuses before any work: Host names it does not
serve (DNS rebinding), bodies that are not application/json, cross-origin browser requests,
bodies past the size limit, a million prompts or a 4 MB message or tool call (while /health
stays responsive), and stop strings past their limits."""

from __future__ import annotations

import json

from .conftest import (
    ADMIN_AUTH,
    ALLOWED_HOST,
    AUTH,
    CHAT,
    COMPLETIONS,
    MSG,
    assert_healthy,
    assert_openai_error,
)


def test_only_loopback_and_allowed_host_names_are_served(server):
    """A page whose name an attacker rebinds to 127.0.0.1 sends its own name as Host: only
    the loopback names and --allowed-hosts are served (tests/serve/test_http_limits.py: the
    same name without --allowed-hosts)."""
    port = server.url.rsplit(":", 1)[1]
    for host in ("localhost", f"LocalHost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}",
                 ALLOWED_HOST, f"{ALLOWED_HOST}:{port}"):
        status, raw = server.request("GET", "/v1/models", headers={**AUTH, "Host": host})
        assert status == 200, (host, raw)
    for host in ("evil.example", f"evil.example:{port}", f"{ALLOWED_HOST}.evil.example",
                 f"127.0.0.1.evil.example:{port}"):
        for method, path, body in (("GET", "/health", None), ("GET", "/metrics", None),
                                   ("POST", COMPLETIONS, {"prompt": "hi", "max_tokens": 2})):
            status, raw = server.request(method, path, body, headers={**AUTH, "Host": host})
            error = assert_openai_error(status, raw, 421, contains=("host name",))
            assert error["code"] == "host_not_allowed"
    # Same origin under an allowed name: Origin and Host agree, and Host is one of ours.
    same_origin = {**AUTH, "Host": f"{ALLOWED_HOST}:{port}",
                   "Origin": f"http://{ALLOWED_HOST}:{port}"}
    status, raw = server.request("POST", COMPLETIONS, {"prompt": "hi", "max_tokens": 2},
                                 headers=same_origin)
    assert status == 200, raw
    assert_healthy(server)


def test_json_routes_take_only_application_json(server):
    for path, body in ((COMPLETIONS, {"prompt": "hi", "max_tokens": 2}),
                       (CHAT, {"messages": MSG, "max_tokens": 2})):
        for content_type in ("text/plain", "application/x-www-form-urlencoded", "", "text/json"):
            status, raw = server.request("POST", path, body,
                                         headers={**AUTH, "Content-Type": content_type})
            error = assert_openai_error(status, raw, 415, contains=("application/json",))
            assert error["code"] == "unsupported_media_type"
    assert_healthy(server)


def test_a_cross_origin_browser_request_is_refused(server):
    for path, body, auth in ((COMPLETIONS, {"prompt": "hi", "max_tokens": 2}, AUTH),
                             ("/reset_prefix_cache", None, ADMIN_AUTH)):
        status, raw = server.request("POST", path, body,
                                     headers={**auth, "Origin": "http://evil.example"})
        assert_openai_error(status, raw, 403, contains=("cross-origin",))
    # An admin route takes no form or text body (what a page may post without asking first).
    status, raw = server.request("POST", "/sleep?level=1", b"x=1",
                                 headers={**ADMIN_AUTH, "Content-Type": "text/plain"})
    assert_openai_error(status, raw, 415)
    same_origin = {**AUTH, "Origin": server.url}
    status, raw = server.request("POST", COMPLETIONS, {"prompt": "hi", "max_tokens": 2},
                                 headers=same_origin)
    assert status == 200, raw


def test_a_body_past_the_limit_is_a_413(server):
    body = b'{"prompt": "' + b"a" * (9 << 20) + b'"}'
    status, raw = server.request("POST", COMPLETIONS, body, headers=AUTH)
    assert_openai_error(status, raw, 413)
    assert_healthy(server)


def test_huge_requests_are_refused_while_health_stays_responsive(server):
    """A million prompts and a 4 MB chat message are refused before any tokenizing, and the
    event loop keeps answering /health meanwhile (each poll's latency, from the client)."""
    import concurrent.futures
    import time

    many = json.dumps({"prompt": ["a"] * 1_000_000, "max_tokens": 1}).encode()
    big_chat = {"messages": [{"role": "user", "content": "word " * 800_000}], "max_tokens": 1}
    done, latencies = [], []

    def poll() -> None:
        while not done:
            start = time.perf_counter()
            status, _ = server.request("GET", "/health", timeout=10)
            latencies.append(time.perf_counter() - start)
            assert status == 200
            time.sleep(0.1)

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        poller = pool.submit(poll)
        first = pool.submit(server.request, "POST", COMPLETIONS, many, AUTH, 60)
        second = pool.submit(server.request, "POST", CHAT, big_chat, AUTH, 60)
        (s1, raw1), (s2, raw2) = first.result(), second.result()
        done.append(True)
        poller.result()
    assert_openai_error(s1, raw1, 400, param="n", contains=("1000000 prompts",))
    assert_openai_error(s2, raw2, 400, param="messages", contains=("characters",))
    assert latencies and max(latencies) < 1.0, latencies


def test_a_chat_is_measured_by_every_text_it_carries(server):
    """Tool-call arguments (and names, ids, content parts) count toward the size bound: a
    4 MB argument is refused before it is decoded or rendered."""
    arguments = json.dumps({"text": "word " * 800_000})
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": None, "tool_calls": [{
                   "id": "call_1", "type": "function",
                   "function": {"name": "echo", "arguments": arguments}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]
    status, raw = server.request("POST", CHAT, {"messages": history, "max_tokens": 1},
                                 headers=AUTH, timeout=60)
    assert_openai_error(status, raw, 400, param="messages", contains=("characters",))
    parts = [{"role": "user", "content": [{"type": "text", "text": "word " * 800_000}]}]
    status, raw = server.request("POST", CHAT, {"messages": parts, "max_tokens": 1},
                                 headers=AUTH, timeout=60)
    assert_openai_error(status, raw, 400, param="messages", contains=("characters",))
    assert_healthy(server)


def test_stop_strings_past_their_limits_are_refused(server):
    for stop, words in ((["x" * 200_000], ("1024",)), (["a"] * 65, ("64",))):
        status, raw = server.request("POST", COMPLETIONS,
                                     {"prompt": "hi", "max_tokens": 2, "stop": stop},
                                     headers=AUTH)
        assert_openai_error(status, raw, 400, param="stop", contains=words)
