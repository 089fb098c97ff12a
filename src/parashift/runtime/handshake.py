"""The head's handshake socket and what it has agreed to: which engine speaks for each rank
and which headless node runs which ranks.

A rank the launcher starts itself (on its own node, or as a Ray actor) is claimed only with
the token it gave that engine; a headless node's rank, by the first engine whose Hello the
head answers for it. No node may hold a rank the launcher starts (its NodeHello is not
answered), so only the launcher reports those ranks' deaths. Either stays claimed until that
engine's death is known (the launcher reaped it, its node reported it, or the coordinator
declared it silent). Meanwhile a Hello for the rank is not answered (an engine says it again
every second until it is: engine/engine_process.py say_hello), and only the claiming
engine's Ready or StartupFailed counts (or, before any engine claimed it, its node's
StartupFailed: a node that refused the head's config). A node's answer carries the config its
first rank's engine gets. Over CURVE the answer carries the rank's key
(`wire/cluster_auth.py` HeadKeys), with which the engine then speaks for the rank everywhere
else. Every peer's identity on this ROUTER is unguessable (`wire/sockets.py` routing_id) and
none is handed over, so no peer can take another's replies."""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable

import msgspec
import zmq

from parashift.wire import protocol as p
from parashift.wire.cluster_auth import HeadKeys
from parashift.wire.sockets import subscriber, tcp_url

logger = logging.getLogger(__name__)


class Handshake:
    def __init__(self, ctx: zmq.Context, num_engines: int, head_keys: HeadKeys | None,
                 engine_init: Callable[[int], p.EngineInit], node_init: p.NodeInit,
                 tokens: dict[int, bytes]):
        """`engine_init(rank)`: the launcher's answer to rank's Hello, without the key;
        `node_init`: its answer to a node's, without the config; `tokens`: those of the ranks
        the launcher starts itself, which their Hellos must carry."""
        self.num_engines = num_engines
        self.tokens = tokens
        self.head_keys = head_keys
        self.engine_init = engine_init
        self.node_init = node_init
        self.socket = ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.ctx = ctx
        # rank -> (identity, pid) of the engine whose Hello was answered for it
        self.claims: dict[int, tuple[bytes, int]] = {}
        self.nodes: dict[bytes, range] = {}  # headless launchers' identities -> their ranks
        self.verdicts: zmq.Socket | None = None  # the coordinator's declared deaths
        # Elastic: why a node may not take these ranks now ("" when it may; runtime/scale.py)
        self.node_refusal: Callable[[range], str] = lambda ranks: ""

    def bind(self, address: str) -> str:
        """Bind at `address` (port 0: one the kernel picks); the address bound."""
        if not address.endswith(":0"):
            self.socket.bind(address)
            return address
        host = address.removeprefix("tcp://").rpartition(":")[0]
        port = self.socket.bind_to_random_port(f"tcp://{host}")
        return tcp_url(host.strip("[]"), port)

    def watch(self, coordinator_publish: str) -> None:
        self.verdicts = subscriber(self.ctx, coordinator_publish)

    def release(self, rank: int) -> None:
        """Rank's engine died: its next engine may say Hello."""
        self.claims.pop(rank, None)

    def receive(self, timeout_ms: int) -> p.Ready | p.StartupFailed | p.EngineDead | None:
        """Answer the Hellos of engines and nodes; the next Ready or StartupFailed from a
        rank's own engine, or death reported by the rank's own node, for the launcher."""
        self._hear_verdicts()
        if not self.socket.poll(timeout_ms):
            return None
        frames = self.socket.recv_multipart()
        if len(frames) != 2:  # a ROUTER frame is [identity, message]: anything else is junk
            p.decode_or_drop(b"", p.Handshake, "handshake")
            return None
        identity, frame = frames
        msg = p.decode_or_drop(frame, p.Handshake, "handshake")
        rank = getattr(msg, "rank", 0)
        if msg is None:
            return None
        if not 0 <= rank < self.num_engines:
            logger.warning("a %s names dp%d, of %d engines: dropped", type(msg).__name__, rank,
                           self.num_engines)
        elif isinstance(msg, p.Hello):
            self._answer_hello(identity, msg)
        elif isinstance(msg, p.NodeHello):
            self._answer_node(identity, msg)
        elif isinstance(msg, p.EngineDead):
            if msg.rank in self.nodes.get(identity, ()) and msg.rank not in self.tokens:
                return msg
            logger.warning("a death of dp%d from a peer that is not its node: dropped", rank)
        elif isinstance(msg, p.Ready | p.StartupFailed):
            if self.claims.get(rank, (b"", 0))[0] == identity:
                return msg
            if (isinstance(msg, p.StartupFailed) and rank not in self.claims
                    and rank in self.nodes.get(identity, ())):
                return msg  # its node refused the head's config before starting any engine
            logger.warning("a %s for dp%d from a peer that is not its engine: dropped",
                           type(msg).__name__, rank)
        return None

    def retire_node_ranks(self, ranks: list[int]) -> None:
        """A scale-down removed `ranks`: each headless node holding some stops them; a node
        left with none exits (and holds nothing here)."""
        for node, held in list(self.nodes.items()):
            leaving = [r for r in held if r in ranks]
            if not leaving:
                continue
            try:
                self.socket.send_multipart([node, p.encode(p.RetireRanks(leaving))],
                                           zmq.NOBLOCK)
            except zmq.ZMQError as e:
                logger.warning("could not tell a headless node to stop %s: %s", leaving, e)
            kept = [r for r in held if r not in ranks]
            if kept:
                self.nodes[node] = range(kept[0], kept[-1] + 1)
            else:
                del self.nodes[node]

    def stop_group(self, engines: dict[int, int], kill: list[int]) -> None:
        """Lockstep over nodes: each headless node stops its ranks' engines among `engines`
        (rank -> pid), killing the ranks in `kill`."""
        for node, ranks in self.nodes.items():
            mine = [(rank, pid) for rank, pid in engines.items() if rank in ranks]
            if not mine:
                continue
            try:
                self.socket.send_multipart([node, p.encode(p.StopGroup(mine, kill))],
                                           zmq.NOBLOCK)
            except zmq.ZMQError as e:
                logger.warning("could not tell a headless node to stop its engines: %s", e)

    def shut_down_nodes(self, timeout: float) -> None:
        for node in self.nodes:  # headless launchers stop their engines
            try:
                self.socket.send_multipart([node, p.encode(p.Shutdown(timeout))], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def _answer_hello(self, identity: bytes, hello: p.Hello) -> None:
        token = self.tokens.get(hello.rank)
        if token is not None and not hmac.compare_digest(token, hello.token):
            logger.warning("a Hello as dp%d without the token its engine was given: not "
                           "answered", hello.rank)
            return
        holder = self.claims.get(hello.rank)
        if holder is not None and holder[0] != identity:
            logger.warning("a Hello as dp%d, whose engine runs: not answered", hello.rank)
            return
        self.claims[hello.rank] = (identity, hello.pid)
        init = self.engine_init(hello.rank)
        if self.head_keys is not None:
            key = self.head_keys.ranks[hello.rank]
            init.rank_key = (key.public, key.secret)
        self.socket.send_multipart([identity, p.encode(init)])

    def _answer_node(self, identity: bytes, hello: p.NodeHello) -> None:
        """A node takes ranks no other node holds, or whose engines all died (it restarted)."""
        ranks = range(hello.start_rank, hello.start_rank + hello.size)
        others: list[bytes] = []
        if not (0 <= ranks.start < ranks.stop <= self.num_engines):  # (before any set of them)
            refusal = f"the launch has {self.num_engines} engines (dp0-dp{self.num_engines - 1})"
        elif owned := [r for r in ranks if r in self.tokens]:
            refusal = f"the head runs {', '.join(f'dp{r}' for r in owned)}"
        else:
            others = [node for node, held in self.nodes.items()
                      if node != identity and set(held) & set(ranks)]
            refusal = ("another node's engines run them"
                       if any(r in self.claims for node in others for r in self.nodes[node])
                       else self.node_refusal(ranks))
        if refusal:
            refusal = f"ranks dp{ranks.start}-dp{ranks.stop - 1} refused: {refusal}"
            logger.warning("a headless node's %s", refusal)
            self.socket.send_multipart([identity, p.encode(p.NodeRefused(refusal))])
            return
        for node in others:
            del self.nodes[node]
        self.nodes[identity] = ranks
        logger.info("a headless node joined with ranks dp%d-dp%d", ranks.start, ranks.stop - 1)
        init = msgspec.structs.replace(self.node_init,
                                       config=self.engine_init(ranks.start).config)
        self.socket.send_multipart([identity, p.encode(init)])

    def _hear_verdicts(self) -> None:
        """Ranks the coordinator declared dead (silent: another node's, or hung) give up their
        claim; a verdict names the engine's pid, so a newer engine's claim stays."""
        while self.verdicts is not None and self.verdicts.poll(0):
            msg = p.decode_or_drop(self.verdicts.recv(), p.FromCoordinator, "verdicts")
            if (isinstance(msg, p.EngineDead) and msg.rank in self.claims
                    and msg.incarnation in (0, self.claims[msg.rank][1])):
                del self.claims[msg.rank]
