"""The calls an API server makes on an engine beside its requests (the admin routes, stats):
one struct each, sent on the requests link and answered with a UtilityResult that carries
the same `call_id`. The engine dispatches them by type (engine/engine_process.py). A new
call (scale, drain) is a new struct here and a handler there."""

from __future__ import annotations

from parashift.wire.message import _Msg


class EngineCall(_Msg):
    call_id: int
    client_index: int  # which API server gets the answer


class Sleep(EngineCall):
    """Answered once the engine has drained: level 1 frees the KV cache, 2 the weights too."""

    level: int


class WakeUp(EngineCall):
    pass


class IsSleeping(EngineCall):
    pass


class ResetPrefixCache(EngineCall):
    pass


class GetStats(EngineCall):
    pass


AnyEngineCall = Sleep | WakeUp | IsSleeping | ResetPrefixCache | GetStats
