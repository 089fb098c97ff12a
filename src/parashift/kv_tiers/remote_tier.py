"""A decode rank's link to the head node's KV server (runtime/kv_server.py): prefill/decode
pools over nodes. Used by the connector's reader thread only (one ZMQ socket, one thread):
the blocks of a continued request that this node's tier lacks are fetched into slots the
connector reserved, then loaded as any tier block. A fetch that times out, or an answer that
is short or malformed, reads fewer blocks: the rest are computed."""

from __future__ import annotations

import itertools
import logging

import zmq

from parashift.kv_tiers.host_arena import HostArena
from parashift.wire import protocol as p

logger = logging.getLogger(__name__)

FETCH_TIMEOUT_S = 10.0


class RemoteTier:
    def __init__(self, ctx: zmq.Context, address: str):
        self.address = address
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.connect(address)
        self._ids = itertools.count()

    def fetch(self, keys: list[int], arena: HostArena, slots: list[int]) -> int:
        """How many of `keys`, from the first, arrived into their `slots`."""
        fetch_id = next(self._ids)
        self.sock.send(p.encode(p.KVFetch(fetch_id, keys)))
        timeout_ms = int(FETCH_TIMEOUT_S * 1000)
        while self.sock.poll(timeout_ms):
            frames = self.sock.recv_multipart(copy=False)
            answer = p.decode_or_drop(frames[0].buffer, p.KVBlocks, "kv-fetch")
            if answer is None or answer.fetch_id != fetch_id:
                continue  # a late answer to a fetch that timed out
            blocks = frames[1:1 + min(answer.num_blocks, len(slots))]
            for done, (frame, slot) in enumerate(zip(blocks, slots, strict=False)):
                if len(frame.buffer) != arena.slot_bytes:
                    return done
                arena.slot(slot)[:] = frame.buffer
            return len(blocks)
        logger.warning("KV fetch from %s: no answer in %.0f s; the blocks are computed",
                       self.address, FETCH_TIMEOUT_S)
        return 0

    def close(self) -> None:
        self.sock.close()
