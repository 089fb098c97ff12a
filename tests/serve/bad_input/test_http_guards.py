"""What the package's server (conftest.py) refuses before any work: bodies that are not
application/json, cross-origin browser requests, bodies past the size limit, a million prompts
or a 4 MB message (while /health stays responsive), and stop strings past their limits."""

from __future__ import annotations

import json

from .conftest import AUTH, CHAT, COMPLETIONS, MSG, assert_healthy, assert_openai_error


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
    for path, body in ((COMPLETIONS, {"prompt": "hi", "max_tokens": 2}),
                       ("/reset_prefix_cache", None)):
        status, raw = server.request("POST", path, body,
                                     headers={**AUTH, "Origin": "http://evil.example"})
        assert_openai_error(status, raw, 403, contains=("cross-origin",))
    # An admin route takes no form or text body (what a page may post without asking first).
    status, raw = server.request("POST", "/sleep?level=1", b"x=1",
                                 headers={**AUTH, "Content-Type": "text/plain"})
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


def test_stop_strings_past_their_limits_are_refused(server):
    for stop, words in ((["x" * 200_000], ("1024",)), (["a"] * 65, ("64",))):
        status, raw = server.request("POST", COMPLETIONS,
                                     {"prompt": "hi", "max_tokens": 2, "stop": stop},
                                     headers=AUTH)
        assert_openai_error(status, raw, 400, param="stop", contains=words)
