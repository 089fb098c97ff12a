"""The base of every message on our sockets: a msgspec struct, msgpack on the wire."""

from __future__ import annotations

import msgspec


class _Msg(msgspec.Struct, array_like=True, gc=False, omit_defaults=True, tag=True,
           forbid_unknown_fields=True):
    """forbid_unknown_fields: an array longer than the message is an error, not a message
    with its trailing fields ignored (a frame that merely starts like ours is never one)."""
