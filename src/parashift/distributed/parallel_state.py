"""The process groups of this process, set once by the worker that owns the model."""

from __future__ import annotations

from parashift.distributed.communicator import GroupCommunicator

_TP_GROUP = GroupCommunicator()


def get_tp_group() -> GroupCommunicator:
    return _TP_GROUP


def set_tp_group(group: GroupCommunicator) -> None:
    global _TP_GROUP
    _TP_GROUP = group
