"""Multi-node data parallel on one machine: a head (`-dp 4 -dpl 2`: API server, coordinator,
ranks 0-1) and a `--headless --data-parallel-start-rank 2` launcher (ranks 2-3), two separate
process trees that meet only over TCP on 127.0.0.1, as two nodes would. The head binds its
handshake on a port the kernel picks (`--data-parallel-rpc-port 0`) and names it in its log;
the node is started with that port."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import psutil
import pytest

from .servers import TINY_ARGS, Server, launch, stop, wait_gone, wait_serving
from .test_data_parallel import PROMPTS, complete, greedy_texts, routed

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def expected(tiny_llama):
    return greedy_texts(tiny_llama)


SECRET = "multi-node-test-secret-0123456789"
SECRET_ENV = {"PARASHIFT_CLUSTER_SECRET": SECRET}


@contextlib.contextmanager
def headless_node(model: str, rpc_port: int, secret: str = SECRET
                  ) -> Iterator[tuple[subprocess.Popen, list[str]]]:
    """The other node's `parashift run --headless` (its output collected), stopped and reaped
    at the end."""
    node = launch(model, [*TINY_ARGS, "--headless", "-dp", "4", "--data-parallel-size-local",
                          "2", "--data-parallel-start-rank", "2", "--data-parallel-address",
                          "127.0.0.1", "--data-parallel-rpc-port", str(rpc_port)],
                  env={"PARASHIFT_CLUSTER_SECRET": secret})
    try:
        yield node.proc, node.lines
    finally:
        stop(node)


HEAD_ARGS = [*TINY_ARGS, "-dp", "4", "--data-parallel-size-local", "2",
             "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", "0"]


@contextlib.contextmanager
def head_node(model: str) -> Iterator[tuple[Server, int]]:
    """The head, and its handshake's port once it listens (the kernel picks it, the log names
    it); `wait_serving` waits for the other node's ranks too."""
    head = launch(model, HEAD_ARGS, env=SECRET_ENV)
    try:
        yield head, int(head.wait_line(r"handshake listens at tcp://127\.0\.0\.1:(\d+)")
                        .group(1))
    finally:
        stop(head)


def engine_children(proc: subprocess.Popen) -> list[psutil.Process]:
    return [p for p in psutil.Process(proc.pid).children(recursive=True)
            if "parashift-engine" in " ".join(p.cmdline()) or "engine" in p.name()]


def test_four_ranks_on_two_nodes_and_a_killed_node_is_skipped(tiny_llama, expected):
    with head_node(tiny_llama) as (head, port), \
            headless_node(tiny_llama, port) as (node, node_lines):
        wait_serving(head)
        # The head's own tree holds ranks 0 and 1 only; 2 and 3 live in the other tree.
        assert {head.engine_process(r).pid for r in (0, 1)}
        with pytest.raises(AssertionError):
            head.engine_process(2)
        node_tree = [psutil.Process(node.pid), *psutil.Process(node.pid).children(recursive=True)]
        assert len(engine_children(node)) == 2, "".join(node_lines)

        before = [routed(head, r) for r in range(4)]
        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            bodies = list(pool.map(lambda p: complete(head, p), PROMPTS))
        for body, want in zip(bodies, expected, strict=True):
            assert body["choices"][0]["text"] == want
        counts = [routed(head, r) - b for r, b in zip(range(4), before, strict=True)]
        assert sum(counts) == len(PROMPTS) and min(counts) > 0, counts
        assert complete(head, PROMPTS[0], rank=3)["choices"][0]["text"] == expected[0]

        # The whole second node goes: its launcher by SIGKILL (its engines follow).
        node.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 15
        while head.get_json("/health")[0] != 503:
            assert time.monotonic() < deadline, "the head never noticed:\n" + head.output()
            time.sleep(0.1)
        deadline = time.monotonic() + 15
        while not {"dp2", "dp3"} <= set(head.get_json("/health")[1]["detail"].split()):
            assert time.monotonic() < deadline, head.get_json("/health")
            time.sleep(0.1)
        assert not wait_gone(node_tree, 15), "the killed node's engines survived"
        before = [routed(head, r) for r in range(4)]
        for prompt, want in zip(PROMPTS[:8], expected[:8], strict=True):
            assert complete(head, prompt)["choices"][0]["text"] == want
        after = [routed(head, r) for r in range(4)]
        assert after[2:] == before[2:] and sum(after) - sum(before) == 8


def rogue_frames(address: str, secret: str | None, hellos: tuple[int, ...] = ()) -> None:
    """What a peer can send the head's handshake port: garbage, multi-part junk, msgpack of
    the wrong shape, an oversized frame and a Hello as each rank of `hellos`; as a stranger
    (`secret` None: plain ZMQ) or with the cluster secret (a broken or compromised node)."""
    import zmq

    from parashift.wire.cluster_auth import ClusterKeys, secured_context

    ctx = secured_context(ClusterKeys.from_secret(secret)) if secret else zmq.Context()
    try:
        rogue = ctx.socket(zmq.DEALER)
        rogue.setsockopt(zmq.LINGER, 1000)
        rogue.setsockopt(zmq.IDENTITY, b"0")  # rank 0's identity
        rogue.connect(address)

        def offer(*frames: bytes) -> None:  # a stranger's connection never opens: no blocking
            with contextlib.suppress(zmq.Again):
                rogue.send_multipart(list(frames), zmq.NOBLOCK)

        offer(b"\xff\x00garbage")
        offer(b"a", b"b", b"c")
        offer(b"\x93\x01\x02\x03")  # a msgpack array that is no message of ours
        offer(b"\x92\xa5Hello\xc0")
        offer(b"x" * (300 << 20))  # past every socket's frame limit
        # A Hello as a running rank gets nothing back (no address, no config, no rank key):
        # from a stranger, whose frames never get through, and from a holder of the secret,
        # since the rank's engine holds it.
        from parashift.wire import protocol as p

        for rank in hellos:
            offer(p.encode(p.Hello(rank, 1)))
        assert not rogue.poll(2000), "a rogue peer got an answer"
        rogue.close()
    finally:
        ctx.destroy(linger=1000)


def rogue_node(address: str, rank: int) -> None:
    """A holder of the secret that says it is the node of ranks `rank`.. `rank` + 1 (the
    head's own), then reports `rank` dead: it is refused, and gets nothing else."""
    import zmq

    from parashift.wire import protocol as p
    from parashift.wire.cluster_auth import ClusterKeys, secured_context
    from parashift.wire.sockets import routing_id

    ctx = secured_context(ClusterKeys.from_secret(SECRET))
    try:
        rogue = ctx.socket(zmq.DEALER)
        rogue.setsockopt(zmq.LINGER, 1000)
        rogue.setsockopt(zmq.IDENTITY, routing_id("node"))
        rogue.connect(address)
        rogue.send(p.encode(p.NodeHello(rank, 2)))
        assert rogue.poll(60_000), "the head did not answer a node's Hello"
        answer = p.decode(rogue.recv(), p.ToNode)
        assert isinstance(answer, p.NodeRefused) and "the head runs" in answer.reason, answer
        rogue.send(p.encode(p.EngineDead(rank, "forged by a rogue node")))
        rogue.close()
    finally:
        ctx.destroy(linger=1000)


def test_rogue_peers_then_a_node_joins_and_the_head_stops_it(tiny_llama):
    """Rogue frames on the handshake port, from a stranger and from a peer with the secret
    (a Hello as the head's dp0 among them), while the head waits for the other node: the head
    survives and answers nothing but a refusal to a node that claims its ranks. Then the node
    joins, every rank answers (pinned requests), a Hello as the node's running dp3 is
    answered by nothing, and the head's shutdown stops the node."""
    with head_node(tiny_llama) as (head, port):
        rogue_frames(f"tcp://127.0.0.1:{port}", None, hellos=(0, 3))
        assert "dropped" not in head.output()  # none got through
        # The head's own ranks are claimed only with the token it gave their engines: a
        # holder of the secret cannot say Hello as one, even before that engine has.
        rogue_frames(f"tcp://127.0.0.1:{port}", SECRET, hellos=(0,))
        head.wait_line("dropped a malformed frame on the handshake link")
        head.wait_line("a Hello as dp0 without the token its engine was given: not answered")
        # Nor can it pass for the node of the head's own ranks and report one dead (during
        # start-up, that would abort the launch).
        rogue_node(f"tcp://127.0.0.1:{port}", 0)
        head.wait_line("a headless node's ranks dp0-dp1 refused: the head runs dp0, dp1")
        head.wait_line("a death of dp0 from a peer that is not its node: dropped")
        with headless_node(tiny_llama, port) as (node, lines):
            wait_serving(head)
            for rank in range(4):  # each node's ranks answer
                assert complete(head, PROMPTS[0], rank=rank)["choices"][0]["text"]
            rogue_frames(f"tcp://127.0.0.1:{port}", SECRET, hellos=(3,))
            head.wait_line("a Hello as dp3, whose engine runs: not answered")
            dropped = "a death of dp0 from a peer that is not its node"
            deaths = head.output().count(dropped)
            rogue_node(f"tcp://127.0.0.1:{port}", 0)  # while serving: dp0 serves on
            deadline = time.monotonic() + 60
            while head.output().count(dropped) == deaths:
                assert time.monotonic() < deadline, head.output()[-3000:]
                time.sleep(0.05)
            assert complete(head, PROMPTS[0], rank=0)["choices"][0]["text"]
            assert "engine dp0 died" not in head.output()
            assert head.get_json("/health")[0] == 200 and head.proc.poll() is None
            head.proc.send_signal(signal.SIGTERM)  # the head tells the node to stop
            assert head.proc.wait(60) == 0, head.output()[-3000:]
            assert node.wait(30) == 0, "".join(lines)
            assert "the head node is shutting down" in "".join(lines)


def test_headless_flags_are_checked(tiny_llama):
    cmd = [sys.executable, "-m", "parashift.cli", "run", tiny_llama, *TINY_ARGS, "--headless",
           "-dp", "4"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--data-parallel-start-rank" in out.stderr
    out = subprocess.run([*cmd[:-2], "-dp", "2", "--data-parallel-start-rank", "1",
                          "--data-parallel-size-local", "2"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "do not fit in --data-parallel-size 2" in out.stderr


def test_a_headless_node_with_the_wrong_secret_exits_saying_so(tiny_llama):
    with head_node(tiny_llama) as (head, port), \
            headless_node(tiny_llama, port, "another-secret-0123456789") as (node, lines):
        assert node.wait(120) != 0, "".join(lines)
        assert "cluster secret differs" in "".join(lines)
        assert head.proc.poll() is None  # the head waits on, untouched


def test_multi_node_without_a_secret_is_refused_with_how_to_make_one(tiny_llama):
    env = {k: v for k, v in os.environ.items() if k != "PARASHIFT_CLUSTER_SECRET"}
    done = subprocess.run([sys.executable, "-m", "parashift.cli", "run", tiny_llama,
                           *HEAD_ARGS], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2 and "needs a cluster secret" in done.stderr, done.stderr
    assert "PARASHIFT_CLUSTER_SECRET" in done.stderr and "--insecure-cluster" in done.stderr
