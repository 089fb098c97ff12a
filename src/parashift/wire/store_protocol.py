"""The expert group's rendezvous store on the wire (distributed/group_store.py): a rank's
torch.distributed store calls, and the launcher's answers.

  launcher ROUTER <- engine or worker DEALER: StoreCall; -> StoreAnswer
"""

from __future__ import annotations

from parashift.wire.message import _Msg


class StoreCall(_Msg):
    """One torch Store operation. `op`: set, get, add, compare_set, delete_key, num_keys,
    check, wait. get and wait are answered once their keys are set (or after `timeout_s`)."""

    call_id: int
    op: str
    keys: list[str]
    value: bytes = b""
    expected: bytes = b""
    amount: int = 0
    timeout_s: float = 0.0


class StoreAnswer(_Msg):
    """`value` for get, add (its decimal), compare_set; `flag` for check and delete_key;
    `count` for num_keys; `error`: why the call was refused or timed out."""

    call_id: int
    value: bytes = b""
    flag: bool = False
    count: int = 0
    error: str = ""
