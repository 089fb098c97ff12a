"""The expert group's rendezvous store, ours rather than torch's TCPStore: the launcher that
owns the group binds it on a socket of its own (ipc:// in the launch's 0700 folder on one
node; tcp:// over nodes and Ray, under ZMQ CURVE), and its address reaches each rank inside
the authenticated handshake. Over CURVE only a rank's key is answered (principal "dp<r>"): a
peer without the cluster secret completes no handshake, one with the secret but no rank's key
is answered nothing, and no frame can stop the server. gloo and NCCL take any
torch.distributed Store: GroupStoreClient is one, whose calls travel as StoreCall messages.

Bounded: keys, values, keys held, bytes held and calls waiting for a key are capped, and a
call over a cap is answered with an error that names it."""

from __future__ import annotations

import datetime
import itertools
import logging
import threading
import time
from dataclasses import dataclass

import torch.distributed as dist
import zmq

from parashift.wire import protocol as p
from parashift.wire.cluster_auth import CurvePair, Role
from parashift.wire.rank_server import RankServer
from parashift.wire.sockets import zmq_context
from parashift.wire.store_protocol import StoreAnswer, StoreCall

logger = logging.getLogger(__name__)

MAX_KEY_BYTES = 1024
MAX_VALUE_BYTES = 1 << 20  # gloo's addresses and NCCL's unique ids are far smaller
MAX_KEYS_PER_CALL = 256
MAX_KEYS = 1 << 16
MAX_HELD_BYTES = 64 << 20
MAX_WAITING_CALLS = 4096
MAX_WAIT_S = 600.0
_OPS = frozenset({"set", "get", "add", "compare_set", "delete_key", "num_keys", "check",
                  "wait"})


@dataclass
class _Waiting:
    identity: bytes
    call: StoreCall
    deadline: float


class GroupStoreServer(RankServer):
    """One incarnation's store, in the launcher: bound at `where` (tcp://host:0 picks a port)
    in `ctx`, which runs CURVE on tcp where the cluster secret is held."""

    link = "expert-store"

    def __init__(self, ctx: zmq.Context, where: str):
        super().__init__(ctx, where, "parashift-expert-store")
        self.data: dict[str, bytes] = {}
        self.held_bytes = 0
        self.waiting: list[_Waiting] = []

    def serve(self, identity: bytes, frame: zmq.Frame) -> None:
        call = p.decode_or_drop(frame.buffer, StoreCall, self.link)
        if call is None:
            return
        refusal = _refusal(call)
        if refusal:
            self._answer(identity, StoreAnswer(call.call_id, error=refusal))
            return
        if call.op in ("get", "wait") and not all(k in self.data for k in call.keys):
            if len(self.waiting) >= MAX_WAITING_CALLS:
                self._answer(identity, StoreAnswer(call.call_id, error=(
                    f"{MAX_WAITING_CALLS} calls wait already")))
                return
            wait_s = min(max(call.timeout_s, 0.0), MAX_WAIT_S)
            self.waiting.append(_Waiting(identity, call, time.monotonic() + wait_s))
            return
        self._answer(identity, self._do(call))

    def _do(self, call: StoreCall) -> StoreAnswer:
        key = call.keys[0] if call.keys else ""
        answer = StoreAnswer(call.call_id)
        if call.op == "get":
            answer.value = self.data[key]
        elif call.op == "wait":
            pass
        elif call.op == "check":
            answer.flag = all(k in self.data for k in call.keys)
        elif call.op == "num_keys":
            answer.count = len(self.data)
        elif call.op == "delete_key":
            answer.flag = self._remove(key)
        elif call.op == "add":
            try:
                total = int(self.data.get(key, b"0")) + call.amount
            except ValueError:
                return StoreAnswer(call.call_id, error=f"key {key!r} holds no number")
            answer.value = str(total).encode()
            answer.error = self._put(key, answer.value)
        elif call.op == "set":
            answer.error = self._put(key, call.value)
        else:  # compare_set
            current = self.data.get(key)
            if current == call.expected or (current is None and not call.expected):
                answer.error = self._put(key, call.value)
                answer.value = call.value
            else:
                answer.value = call.expected if current is None else current
        if not answer.error and call.op in ("set", "add", "compare_set"):
            self._wake()
        return answer

    def _put(self, key: str, value: bytes) -> str:
        grows = len(value) + len(key) - (len(self.data[key]) + len(key) if key in self.data
                                         else 0)
        if key not in self.data and len(self.data) >= MAX_KEYS:
            return f"the store holds {MAX_KEYS} keys already"
        if self.held_bytes + grows > MAX_HELD_BYTES:
            return f"the store would hold over {MAX_HELD_BYTES} bytes"
        self.data[key] = value
        self.held_bytes += grows
        return ""

    def _remove(self, key: str) -> bool:
        value = self.data.pop(key, None)
        if value is None:
            return False
        self.held_bytes -= len(key) + len(value)
        return True

    def _wake(self) -> None:
        ready = [w for w in self.waiting if all(k in self.data for k in w.call.keys)]
        self.waiting = [w for w in self.waiting if w not in ready]
        for w in ready:
            self._answer(w.identity, self._do(w.call))

    def tick(self, now: float) -> None:
        """Waiting calls past their time are answered with an error."""
        late = [w for w in self.waiting if w.deadline <= now]
        if not late:
            return
        self.waiting = [w for w in self.waiting if w.deadline > now]
        for w in late:
            missing = [k for k in w.call.keys if k not in self.data]
            self._answer(w.identity, StoreAnswer(w.call.call_id, error=(
                f"timed out waiting for {', '.join(missing[:4])}")))

    def _answer(self, identity: bytes, answer: StoreAnswer) -> None:
        try:
            self.sock.send_multipart([identity, p.encode(answer)], zmq.NOBLOCK)
        except zmq.ZMQError as e:  # a peer gone or not reading: its loss alone
            logger.warning("expert-group store: an answer not sent (%s)", e)


def _refusal(call: StoreCall) -> str:
    """Why `call` is refused ("" if it is not)."""
    if call.op not in _OPS:
        return f"unknown store operation {call.op[:32]!r}"
    if not call.keys and call.op != "num_keys":
        return f"{call.op} names no key"
    if len(call.keys) > MAX_KEYS_PER_CALL:
        return f"{len(call.keys)} keys in one call (at most {MAX_KEYS_PER_CALL})"
    if any(len(k.encode()) > MAX_KEY_BYTES for k in call.keys):
        return f"a key over {MAX_KEY_BYTES} bytes"
    if max(len(call.value), len(call.expected)) > MAX_VALUE_BYTES:
        return f"a value over {MAX_VALUE_BYTES} bytes"
    return ""


class GroupStoreClient(dist.Store):
    """A rank's side: each Store call is one StoreCall, answered by the launcher's server.
    `key`: the rank's CURVE key pair (over tcp under the cluster secret), or None."""

    def __init__(self, address: str, key: tuple[bytes, bytes] | None,
                 timeout: datetime.timedelta):
        super().__init__()
        self.address = address
        self.timeout_s = timeout.total_seconds()
        self._ctx = zmq_context(role=Role(CurvePair(*key)) if key else None)
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(address)
        self._ids = itertools.count()
        self._lock = threading.Lock()  # one call at a time on the socket

    def _call(self, op: str, keys: list[str], timeout_s: float | None = None,
              **fields) -> StoreAnswer:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        call = StoreCall(next(self._ids), op, keys, timeout_s=timeout_s, **fields)
        deadline = time.monotonic() + timeout_s + 5.0  # the server answers a wait first
        with self._lock:
            self._sock.send(p.encode(call))
            while (left := deadline - time.monotonic()) > 0:
                if not self._sock.poll(int(left * 1000) + 1):
                    break
                answer = p.decode_or_drop(self._sock.recv(), StoreAnswer, "expert-store")
                if answer is None or answer.call_id != call.call_id:
                    continue  # a late answer to a call that timed out
                if answer.error:
                    raise dist.DistStoreError(
                        f"expert-group store at {self.address}: {op} {keys[:2]}: {answer.error}")
                return answer
        raise dist.DistStoreError(f"expert-group store at {self.address}: no answer to {op} "
                                  f"{keys[:2]} within {timeout_s:.0f} s")

    def set(self, key: str, value) -> None:
        self._call("set", [key], value=_as_bytes(value))

    def get(self, key: str) -> bytes:
        return self._call("get", [key]).value

    def add(self, key: str, amount: int) -> int:
        return int(self._call("add", [key], amount=amount).value)

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self._call("compare_set", [key], expected=_as_bytes(expected),
                          value=_as_bytes(desired)).value

    def delete_key(self, key: str) -> bool:
        return self._call("delete_key", [key]).flag

    def num_keys(self) -> int:
        return self._call("num_keys", []).count

    def check(self, keys: list[str]) -> bool:
        return self._call("check", list(keys)).flag

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._call("wait", list(keys),
                   None if timeout is None else min(timeout.total_seconds(), self.timeout_s))

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.timeout_s = timeout.total_seconds()

    def close(self) -> None:
        self._sock.close()
        self._ctx.term()


def _as_bytes(value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)
