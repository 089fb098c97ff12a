"""The expert-parallel group that spans the engines: the ranks with one tp coordinate, one per
engine. It is a process group of its own (gloo on CPU, nccl on GPU), apart from each engine's
in-engine world, so that an engine without workers (tp1) joins it from its own process.

Rendezvous: a TCP store that the launcher hosts for each incarnation of the group (a
restarted group gets a new one, at a new port) and whose address it hands every engine.
A peer that dies closes its connections, and a collective waiting on it fails at once; one
that hangs fails after EP_COLLECTIVE_TIMEOUT."""

from __future__ import annotations

import datetime

import torch.distributed as dist

from parashift.distributed.communicator import GroupCommunicator
from parashift.strategies.spec import StrategySpec
from parashift.wire.sockets import listen_tcp, tcp_url

EP_COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)
JOIN_TIMEOUT = datetime.timedelta(minutes=10)  # the other engines may still be loading


class GroupStore:
    """The store of one incarnation, in the launcher: it listens on a socket bound on `host`
    alone at a port the kernel picks (by itself torch's TCPStore listens on every interface,
    whatever host it is given), so no port is picked, released and bound again."""

    def __init__(self, host: str):
        listener = listen_tcp(host, 0, 256)
        port = listener.getsockname()[1]
        self.address = tcp_url(host, port)
        self.store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                   timeout=JOIN_TIMEOUT, master_listen_fd=listener.detach())


def join_expert_group(address: str, coords: dict[str, int], sizes: dict[str, int],
                      on_gpu: bool) -> GroupCommunicator:
    """`address`: tcp://host:port of the group's store."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    host = host.strip("[]")
    engines, tp_rank = sizes.get("dp", 1), coords.get("tp", 0)
    rank = coords.get("dp", 0)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=JOIN_TIMEOUT)
    prefixed = dist.PrefixStore(f"ep-tp{tp_rank}", store)
    if on_gpu:
        group = dist.ProcessGroupNCCL(prefixed, rank, engines)
    else:  # gloo's pairs on `host`'s interface too, not the one the hostname resolves to
        options = dist.ProcessGroupGloo._Options()
        options._timeout = EP_COLLECTIVE_TIMEOUT
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        group = dist.ProcessGroupGloo(prefixed, rank, engines, options)
    return GroupCommunicator(group, rank, engines)  # the group keeps its store alive


def cross_engine_groups(spec: StrategySpec, address: str | None, coords: dict[str, int],
                        on_gpu: bool) -> dict[str, GroupCommunicator]:
    """The groups of this rank that span engines and carry a model's collectives: `ep` when
    the strategy shards experts over more than one engine (dp stays collective-free)."""
    sizes = spec.sizes()
    if sizes.get("dp", 1) == 1 or not any(g.name == "ep" for g in spec.groups()):
        return {}
    if address is None:
        raise ValueError(f"strategy {spec}: expert parallel over engines runs only under "
                         "'parashift run' (its launcher gives the engines their meeting point)")
    return {"ep": join_expert_group(address, coords, sizes, on_gpu)}
