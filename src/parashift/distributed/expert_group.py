"""The expert-parallel group that spans the engines: the ranks with one tp coordinate, one per
engine. It is a process group of its own (gloo on CPU, nccl on GPU), apart from each engine's
in-engine world, so that an engine without workers (tp1) joins it from its own process.

Rendezvous: a store that the launcher hosts for each incarnation of the group
(distributed/group_store.py: a restarted group gets a new one, at a new address, so no engine
of the old incarnation can join the new one); its address and the rank's key reach the engine
in the authenticated handshake. Each rank's gloo pairs listen on its own node's interface
towards the store's host. A peer that dies closes its connections, and a collective waiting
on it fails at once; one that hangs fails after EP_COLLECTIVE_TIMEOUT."""

from __future__ import annotations

import datetime

import torch.distributed as dist

from parashift.distributed.communicator import GroupCommunicator
from parashift.distributed.group_store import GroupStoreClient
from parashift.distributed.network_interface import address_towards
from parashift.strategies.spec import StrategySpec

EP_COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)
JOIN_TIMEOUT = datetime.timedelta(minutes=10)  # the other engines may still be loading


def join_expert_group(address: str, key: tuple[bytes, bytes] | None, coords: dict[str, int],
                      sizes: dict[str, int], on_gpu: bool) -> GroupCommunicator:
    """`address`: the group's store (ipc:// or tcp://host:port); `key`: this rank's."""
    engines, tp_rank = sizes.get("dp", 1), coords.get("tp", 0)
    rank = coords.get("dp", 0)
    store = GroupStoreClient(address, key, JOIN_TIMEOUT)
    prefixed = dist.PrefixStore(f"ep-tp{tp_rank}", store)
    if on_gpu:
        group = dist.ProcessGroupNCCL(prefixed, rank, engines)
    else:  # gloo's pairs on this node's interface towards the store's host, not on the one
        # the host name resolves to
        host = (address.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
                if address.startswith("tcp://") else "127.0.0.1")
        options = dist.ProcessGroupGloo._Options()
        options._timeout = EP_COLLECTIVE_TIMEOUT
        options._devices = [dist.ProcessGroupGloo.create_device(
            hostname=address_towards(host))]
        group = dist.ProcessGroupGloo(prefixed, rank, engines, options)
    return GroupCommunicator(group, rank, engines)  # the group keeps its store alive


def cross_engine_groups(spec: StrategySpec, address: str | None,
                        key: tuple[bytes, bytes] | None, coords: dict[str, int],
                        on_gpu: bool) -> dict[str, GroupCommunicator]:
    """The groups of this rank that span engines and carry a model's collectives: `ep` when
    the strategy shards experts over more than one engine (dp stays collective-free)."""
    sizes = spec.sizes()
    if sizes.get("dp", 1) == 1 or not any(g.name == "ep" for g in spec.groups()):
        return {}
    if address is None:
        raise ValueError(f"strategy {spec}: expert parallel over engines runs only under "
                         "'parashift run' (its launcher gives the engines their meeting point)")
    return {"ep": join_expert_group(address, key, coords, sizes, on_gpu)}
