"""The life of a real `parashift run`: ready when it says so, a clean SIGTERM (drains in-flight
requests, exits 0, leaves no process behind), and an engine killed under load (in-flight
requests fail fast, /health turns 503)."""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import socket
import tempfile
import threading
import time

import openai
import psutil
import pytest

from .servers import (
    LONG_ARGS,
    SHUTDOWN_TIMEOUT,
    TINY_ARGS,
    fork_server_folder,
    http_request,
    launch,
    live,
    running_server,
    stop,
    wait_gone,
    wait_serving,
)

# tiny_llama with a tokenizer that takes seconds to load: only the API server loads it, so the
# engine is ready first and the API server learns it late, every time.
NUM_SLOW_TOKENS = 40_000


@pytest.fixture(scope="module")
def slow_tokenizer_model(tiny_llama, tmp_path_factory) -> str:
    from transformers import AutoTokenizer

    folder = str(tmp_path_factory.mktemp("tiny-llama-slow-tokenizer"))
    shutil.copytree(tiny_llama, folder, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    tokenizer.add_tokens([f"<unused_{i}>" for i in range(NUM_SLOW_TOKENS)])
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def server(slow_tokenizer_model):
    with running_server(slow_tokenizer_model, *TINY_ARGS) as s:
        yield s


def process_names(procs: list[psutil.Process]) -> list[str]:
    names = []
    for p in procs:
        try:
            names.append(" ".join([p.name(), *p.cmdline()]))
        except psutil.Error:
            pass
    return names


def test_health_is_ok_once_is_serving_is_printed(server):
    status, body = server.health_at_start
    assert status == 200, body


def test_requests_sent_during_start_up_wait_for_the_engines(tiny_llama):
    """The API servers accept only once every engine is ready (vLLM's behaviour): a client
    that calls from the launch on waits in the listener's backlog and is answered 200, never
    503 "not ready yet"."""
    answers: dict[str, tuple[int, bytes]] = {}
    name = os.path.basename(tiny_llama.rstrip("/"))
    body = json.dumps({"model": name, "prompt": "hi", "max_tokens": 2}).encode()
    server = launch(tiny_llama, TINY_ARGS)
    try:  # the port is bound (and named) first, the engines start after
        url = server.wait_line(r"HTTP listens at (http://\S+);").group(1)

        def call(method: str, path: str, data: bytes | None) -> None:
            answers[path] = http_request(method, url + path, data, timeout=120)

        callers = [threading.Thread(target=call, args=("GET", "/health", None)),
                   threading.Thread(target=call, args=("POST", "/v1/completions", body))]
        for t in callers:
            t.start()
        wait_serving(server)
        for t in callers:
            t.join(120)
    finally:
        stop(server)
    assert answers["/health"][0] == 200, answers
    assert answers["/v1/completions"][0] == 200, answers


def test_sigterm_drains_and_exits_cleanly(server):
    tree = server.current_tree()
    names = process_names(tree)
    assert any("parashift-api-0" in n for n in names), names
    assert any("parashift-engine-dp0" in n for n in names), names
    assert any("parashift-forkserver" in n for n in names), names  # the children's fork server
    socket_folder = fork_server_folder(tree)
    assert os.path.isdir(socket_folder)
    client = server.client()
    stream = client.completions.create(
        model=server.model_name, prompt="hi", max_tokens=200, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    first = next(chunks)
    start = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    # The request in flight is drained, not cut.
    rest = list(chunks)
    finish = [c.choices[0].finish_reason for c in [first, *rest] if c.choices]
    assert finish[-1] == "length" and finish.count("length") == 1
    assert rest[-1].usage.completion_tokens == 200
    code = server.proc.wait(SHUTDOWN_TIMEOUT)
    elapsed = time.monotonic() - start
    print(f"launcher exited {elapsed:.2f} s after SIGTERM")
    assert code == 0, server.output()[-3000:]
    assert elapsed < SHUTDOWN_TIMEOUT
    left = wait_gone(tree, 5)
    assert left == [], f"left behind: {process_names(left)}"
    assert not os.path.exists(socket_folder)  # the launcher's exit skips multiprocessing's
    assert "received SIGTERM" in server.output()
    port = int(server.url.rsplit(":", 1)[1])
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_engine_killed_mid_stream(tiny_llama_long):
    with running_server(tiny_llama_long, *LONG_ARGS) as server:
        client = server.client(timeout=30.0)
        engine = server.engine_process(0)
        # A second request in flight, not streamed: it must fail too, not hang.
        whole: dict = {}

        def non_streaming() -> None:
            whole["result"] = server.request("POST", "/v1/completions", {
                "prompt": "ho", "max_tokens": 8000, "temperature": 0, "ignore_eos": True},
                timeout=30)

        thread = threading.Thread(target=non_streaming, daemon=True)
        stream = client.completions.create(
            model=server.model_name, prompt="hi", max_tokens=8000, temperature=0, stream=True,
            extra_body={"ignore_eos": True})
        chunks = iter(stream)
        for _ in range(3):
            next(chunks)
        thread.start()
        deadline = time.monotonic() + 10
        while server.metric("parashift_num_requests_running", 'engine="dp0"') != 2:
            assert time.monotonic() < deadline, "the second request never started"
            time.sleep(0.02)
        engine.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(openai.APIError) as info:
            for _ in chunks:
                assert time.monotonic() - killed < 15, "the stream went on after the kill"
        assert time.monotonic() - killed < 10
        assert not isinstance(info.value, openai.APITimeoutError)
        assert "dp0" in info.value.message
        thread.join(15)
        assert not thread.is_alive(), "the non-streaming request hung"
        status, raw = whole["result"]
        assert status == 500, raw
        error = json.loads(raw)["error"]
        assert "dp0" in error["message"] and error["type"] == "engine_error"

        status, body = server.get_json("/health")
        assert status == 503 and body["status"] == "unavailable"
        assert "dp0" in body["detail"]
        status, raw = server.request("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert status == 503
        assert "dp0" in json.loads(raw)["error"]["message"]
        assert server.metric("parashift_engine_up", 'engine="dp0"') == 0
        assert "engine dp0 died" in server.output()
        assert live([engine]) == []
        assert server.proc.poll() is None  # the API keeps answering: a supervisor decides


def test_children_die_with_a_killed_launcher(tiny_llama):
    """SIGKILL leaves the launcher no chance to clean up: its children must go by themselves,
    and take its ipc folder and the fork server's socket folder with them."""
    launch_folders = os.path.join(tempfile.gettempdir(), "parashift-*")
    before = set(glob.glob(launch_folders))
    with running_server(tiny_llama, *TINY_ARGS) as server:
        tree = server.current_tree()
        children = [p for p in tree if p.pid != server.proc.pid]
        names = process_names(children)
        assert any("parashift-api-0" in n for n in names), names
        assert any("parashift-engine-dp0" in n for n in names), names
        socket_folder = fork_server_folder(children)
        server.proc.send_signal(signal.SIGKILL)
        assert server.proc.wait(5) == -signal.SIGKILL
        left = wait_gone(children, 10)
        assert left == [], f"orphans of a killed launcher: {process_names(left)}"
        assert set(glob.glob(launch_folders)) <= before
        assert not os.path.exists(socket_folder)
