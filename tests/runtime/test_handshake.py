"""The head's handshake: the engine to say Hello as a rank (with the launcher's token, for a
rank the launcher starts itself; first, for a headless node's) speaks for it (its Ready
counts, and over CURVE it gets the rank's key) until its death is known; headless nodes hold
their ranks; what another peer says for them is dropped; an engine says Hello again until
it is answered. Real ZMQ sockets (ipc)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest
import zmq

from parashift.engine.engine_process import say_hello
from parashift.runtime.handshake import Handshake
from parashift.wire import protocol as p
from parashift.wire.cluster_auth import HeadKeys
from parashift.wire.sockets import routing_id


@pytest.fixture
def desk(tmp_path):
    ctx = zmq.Context()
    keys = HeadKeys.mint(3)
    handshake = Handshake(ctx, 3, keys, lambda rank: p.EngineInit(  # type: ignore[arg-type]
        None, [f"requests-of-dp{rank}"], []), p.NodeInit("publish"), {0: TOKEN})
    address = handshake.bind(f"ipc://{tmp_path}/handshake")
    peers: list[zmq.Socket] = []

    def peer(name: str) -> zmq.Socket:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, routing_id(name))
        sock.connect(address)
        peers.append(sock)
        return sock

    yield handshake, keys, peer
    for sock in peers:
        sock.close()
    handshake.socket.close()
    ctx.term()


TOKEN = b"dp0's token, from the launcher"


RANK_KEY = p.EngineInit.__struct_fields__.index("rank_key")  # its place in init_fields


def init_fields(sock: zmq.Socket) -> list:
    """An EngineInit's fields (the test's config is a placeholder no decoder would take)."""
    tag, *fields = msgspec.msgpack.decode(sock.recv())
    assert tag == "EngineInit"
    return fields


def said(handshake: Handshake, sock: zmq.Socket, msg: p._Msg):
    """What the head makes of `msg` from `sock` (it reads one frame)."""
    sock.send(p.encode(msg))
    assert handshake.socket.poll(10_000)
    return handshake.receive(0)


def test_a_rank_is_its_first_engines_until_that_engine_dies(desk):
    handshake, keys, peer = desk
    engine, other = peer("dp1"), peer("dp1")
    assert said(handshake, engine, p.Hello(1, 100)) is None
    init = init_fields(engine)
    assert init[1] == ["requests-of-dp1"]
    assert init[RANK_KEY] == [keys.ranks[1].public, keys.ranks[1].secret]
    assert said(handshake, other, p.Hello(1, 200)) is None
    assert not other.poll(0) and handshake.claims[1][1] == 100  # not answered
    ready = p.Ready(1, 10, 16, 256, [0])
    assert said(handshake, other, ready) is None  # only the claimant's Ready counts
    assert said(handshake, other, p.StartupFailed(1, "forged")) is None
    assert said(handshake, engine, ready) == ready
    assert said(handshake, other, p.Hello(7, 200)) is None  # no such rank
    assert not other.poll(0)

    handshake.release(1)  # the launcher saw it die: the next engine may claim the rank
    assert said(handshake, other, p.Hello(1, 200)) is None
    assert init_fields(other)[RANK_KEY][0] == keys.ranks[1].public


def test_a_restarted_engine_says_hello_again_until_its_nodes_death_report_arrives(desk):
    """A headless node restarts a dead engine, and the new engine's Hello can reach the head
    before the node's report of the death: that Hello is not answered (the rank is still
    the dead engine's), so the engine says it again until the report frees the rank."""
    handshake, keys, peer = desk
    node = peer("node-1")
    assert said(handshake, node, p.NodeHello(1, 2)) is None
    assert p.decode(node.recv(), p.ToNode) == p.NodeInit("publish")
    said(handshake, peer("dp2"), p.Hello(2, 300))
    restarted = peer("dp2")
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(say_hello, restarted, p.Hello(2, 301), 60)
        assert handshake.receive(10_000) is None  # its first Hello: dp2 is still pid 300's
        assert handshake.claims[2][1] == 300 and not answer.done()
        death = p.EngineDead(2, "killed", 300)
        assert said(handshake, node, death) == death
        handshake.release(2)  # as the launcher does with the death
        while not answer.done():  # its next Hello is answered
            handshake.receive(100)
        fields = msgspec.msgpack.decode(answer.result())
    assert fields[0] == "EngineInit" and fields[1 + RANK_KEY][0] == keys.ranks[2].public
    assert handshake.claims[2][1] == 301


def test_an_unanswered_hello_times_out():
    ctx = zmq.Context()
    try:
        lonely = ctx.socket(zmq.DEALER)
        lonely.setsockopt(zmq.LINGER, 0)
        lonely.connect("tcp://127.0.0.1:9")  # nobody listens
        with pytest.raises(TimeoutError, match="no launcher answered the handshake"):
            say_hello(lonely, p.Hello(0, 1), 0.2)
        lonely.close()
    finally:
        ctx.term()


def refusal(node) -> str:
    msg = p.decode(node.recv(), p.ToNode)
    assert isinstance(msg, p.NodeRefused), msg
    return msg.reason


def test_a_node_reports_only_its_own_ranks_deaths(desk):
    handshake, _, peer = desk
    node, rogue = peer("node-1"), peer("node-1")
    assert said(handshake, node, p.NodeHello(1, 2)) is None
    assert p.decode(node.recv(), p.ToNode) == p.NodeInit("publish")
    death = p.EngineDead(2, "killed", 5)
    assert said(handshake, rogue, death) is None  # not its node
    assert said(handshake, node, p.EngineDead(0, "killed", 5)) is None  # not its rank
    assert said(handshake, node, death) == death
    # While rank 2's engine runs, another node cannot take the ranks over; once no engine
    # of the old node's holds one, a restarted node can.
    engine = peer("dp2")
    said(handshake, engine, p.Hello(2, 300))
    for hello, reason in [((2, 1), "ranks dp2-dp2 refused: another node's engines run them"),
                          ((-1, 2), "ranks dp-1-dp0 refused: the launch has 3 engines"),
                          ((1, 2**62), "refused: the launch has 3 engines (dp0-dp2)")]:
        assert said(handshake, rogue, p.NodeHello(*hello)) is None
        assert reason in refusal(rogue)
    handshake.release(2)
    assert said(handshake, rogue, p.NodeHello(1, 2)) is None
    assert p.decode(rogue.recv(), p.ToNode) == p.NodeInit("publish")
    assert list(handshake.nodes.values()) == [range(1, 3)]


def test_no_node_holds_or_reports_the_death_of_a_rank_the_launcher_starts(desk):
    """dp0 is the launcher's own (it gave its engine the token): a node that claims it is
    not answered, and its EngineDead for dp0 is dropped, before and after dp0's engine says
    Hello; dp0's claim stays its engine's."""
    handshake, _, peer = desk
    rogue, engine = peer("node-0"), peer("dp0")
    death = p.EngineDead(0, "forged", 0)
    assert said(handshake, rogue, p.NodeHello(0, 2)) is None
    assert refusal(rogue) == "ranks dp0-dp1 refused: the head runs dp0"
    assert said(handshake, rogue, p.NodeHello(0, 1)) is None
    assert refusal(rogue) == "ranks dp0-dp0 refused: the head runs dp0"
    assert handshake.nodes == {}
    assert said(handshake, rogue, death) is None
    assert said(handshake, engine, p.Hello(0, 200, TOKEN)) is None
    init_fields(engine)
    assert said(handshake, rogue, death) is None
    assert said(handshake, rogue, p.StartupFailed(0, "forged")) is None
    assert handshake.claims[0][1] == 200
    # The ranks the launcher does not start stay free for a node.
    assert said(handshake, rogue, p.NodeHello(1, 2)) is None
    assert p.decode(rogue.recv(), p.ToNode) == p.NodeInit("publish")
    assert said(handshake, rogue, death) is None


def test_a_rank_the_launcher_starts_is_claimed_only_with_its_token(desk):
    handshake, keys, peer = desk
    rogue, engine = peer("dp0"), peer("dp0")
    assert said(handshake, rogue, p.Hello(0, 100)) is None  # no token
    assert said(handshake, rogue, p.Hello(0, 100, b"a guess")) is None
    assert not rogue.poll(0) and 0 not in handshake.claims
    assert said(handshake, engine, p.Hello(0, 200, TOKEN)) is None
    assert init_fields(engine)[RANK_KEY][0] == keys.ranks[0].public
    assert handshake.claims[0][1] == 200


def test_a_node_gets_its_first_ranks_config_and_may_refuse_its_unclaimed_ranks(tmp_path):
    """The NodeInit carries the config the node's first rank's engine gets (never a rank
    key); a node that refuses it says so for its own ranks, before an engine claims them."""
    from .test_headless import head_config

    ctx = zmq.Context()
    configs = {rank: msgspec.structs.replace(head_config(), parallel=msgspec.structs.replace(
        head_config().parallel, data_parallel_rank=rank)) for rank in range(4)}
    handshake = Handshake(ctx, 4, HeadKeys.mint(4), lambda rank: p.EngineInit(
        configs[rank], [], []), p.NodeInit("publish"), {})
    address = handshake.bind(f"ipc://{tmp_path}/handshake")
    node, engine = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    for sock, name in ((node, "node-2"), (engine, "dp3")):
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, routing_id(name))
        sock.connect(address)
    try:
        assert said(handshake, node, p.NodeHello(2, 2)) is None
        init = p.decode(node.recv(), p.ToNode)
        assert init == p.NodeInit("publish", configs[2])
        refusal = p.StartupFailed(2, "node b: the head resolved dtype bfloat16, ...")
        assert said(handshake, node, refusal) == refusal
        assert said(handshake, node, p.StartupFailed(1, "not its rank")) is None
        said(handshake, engine, p.Hello(3, 300))  # dp3's engine claims it: its own word only
        assert said(handshake, node, p.StartupFailed(3, "claimed")) is None
    finally:
        node.close()
        engine.close()
        handshake.socket.close()
        ctx.term()


def test_a_broken_lockstep_group_is_stopped_on_each_node_by_pid(desk):
    """StopGroup tells each node only its own ranks' engines of the broken incarnation (rank,
    pid), and which to kill: an engine that restarted since (another pid) is not named."""
    handshake, _, peer = desk
    first, second = peer("node-1"), peer("node-2")
    said(handshake, first, p.NodeHello(1, 1))
    said(handshake, second, p.NodeHello(2, 1))
    for node in (first, second):
        assert isinstance(p.decode(node.recv(), p.ToNode), p.NodeInit)
    handshake.stop_group({0: 10, 1: 11, 2: 12}, kill=[2])
    assert p.decode(first.recv(), p.ToNode) == p.StopGroup([(1, 11)], [2])
    assert p.decode(second.recv(), p.ToNode) == p.StopGroup([(2, 12)], [2])
    handshake.stop_group({0: 10}, kill=[])  # the head's own rank only: no node is told...
    handshake.stop_group({1: 21, 2: 22}, kill=[])  # ...so each node's next word is this one
    assert p.decode(first.recv(), p.ToNode) == p.StopGroup([(1, 21)], [])
    assert p.decode(second.recv(), p.ToNode) == p.StopGroup([(2, 22)], [])
