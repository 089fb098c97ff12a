"""The serve tests' fixtures (tiny models, a tokenizer), what a failing test's report carries
(the output of the servers it ran: servers.py), and a check of a launcher's CURVE socket."""

from __future__ import annotations

import contextlib

import pytest

from .servers import LAUNCHED, LONG_MAX_MODEL_LEN, OUTPUT_IN_REPORT, Server


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "setup":
        LAUNCHED[:] = [s for s in LAUNCHED if s.proc.poll() is None]  # the module's still run
    if not report.failed:
        return report
    given = [v for v in getattr(item, "funcargs", {}).values() if isinstance(v, Server)]
    for server in {id(s): s for s in [*given, *LAUNCHED]}.values():
        report.sections.append((f"output of `{' '.join(server.cmd[3:5])}` (last "
                                f"{OUTPUT_IN_REPORT} characters)",
                                server.output()[-OUTPUT_IN_REPORT:]))
    return report


@pytest.fixture(scope="session")
def tiny_llama_long(tiny_model_factory) -> str:
    """tiny_llama's weights (same seed and shapes) with room for LONG_MAX_MODEL_LEN tokens."""
    return tiny_model_factory("llama", max_position_embeddings=LONG_MAX_MODEL_LEN)


@pytest.fixture(scope="session")
def mixtral(tiny_model_factory) -> str:
    """The tiny MoE model of test_expert_parallel*.py."""
    return tiny_model_factory("mixtral")  # 5 experts: 3 on dp0, 2 on dp1


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama)


def strangers_get_nothing(address: str, frames: list[bytes], secret: str, monkeypatch) -> None:
    """Peers on a launcher's CURVE socket at `address` send `frames`, one message each: one
    without the cluster secret (its handshake cannot complete), then one with the secret but
    no rank's key (its frames are dropped). Neither is answered."""
    import zmq

    plain = zmq.Context()
    try:
        sock = plain.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        for frame in frames:
            with contextlib.suppress(zmq.Again):  # (no peer ever completes: nothing queues)
                sock.send(frame, zmq.NOBLOCK)
        assert not sock.poll(1500)
    finally:
        plain.destroy(linger=0)
    monkeypatch.setenv("PARASHIFT_CLUSTER_SECRET", secret)
    from parashift.wire.sockets import zmq_context

    member = zmq_context()
    try:
        sock = member.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        for frame in frames:
            sock.send(frame)
        assert not sock.poll(1500)
    finally:
        member.destroy(linger=0)
