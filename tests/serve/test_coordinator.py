"""The DP coordinator over real ZMQ sockets: load changes are published within ~100 ms, and a
heartbeat keeps coming when nothing changes."""

from __future__ import annotations

import threading
import time

import zmq

from parashift.serve import protocol as p
from parashift.serve.coordinator import HEARTBEAT_INTERVAL_S, Coordinator


def test_publishes_changes_fast_and_heartbeats(tmp_path):
    load_address, pub_address = f"ipc://{tmp_path}/load", f"ipc://{tmp_path}/pub"
    coordinator = Coordinator(2, load_address, pub_address)
    thread = threading.Thread(target=coordinator.run, daemon=True)
    thread.start()
    ctx = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub_address)
        push = ctx.socket(zmq.PUSH)
        push.connect(load_address)
        assert sub.poll(int(2000 * HEARTBEAT_INTERVAL_S))  # joined: a heartbeat arrives
        first = p.decode(sub.recv(), p.LoadVector)
        assert [load.rank for load in first.loads] == [0, 1]

        sent = time.monotonic()
        push.send(p.encode(p.EngineLoad(1, 3, 5, 0.25)))
        while True:
            assert sub.poll(2000)
            vector = p.decode(sub.recv(), p.LoadVector)
            if vector.loads[1].num_waiting == 3:
                break
        assert time.monotonic() - sent < 0.5  # well before the next heartbeat
        assert vector.loads[1] == p.EngineLoad(1, 3, 5, 0.25)
        assert vector.seq > first.seq

        start = time.monotonic()  # no change: the next message is a heartbeat, ~1 s later
        assert sub.poll(int(3000 * HEARTBEAT_INTERVAL_S))
        heartbeat = p.decode(sub.recv(), p.LoadVector)
        assert heartbeat.loads == vector.loads
        assert time.monotonic() - start > 0.5 * HEARTBEAT_INTERVAL_S
    finally:
        coordinator.stopping = True
        thread.join(5)
        coordinator.close()
        ctx.destroy(linger=0)
