"""Sleep and wake of one engine process (POST /sleep, /wake_up on the API server, which calls
every engine): level 1 frees the KV cache, level 2 the weights too.

A sleep call is answered once the engine has drained: no request left and, in a lockstep
group, no wave running, so no rank sleeps mid-wave. From the call on, a new request is
refused with a 503 (`--while-asleep reject`, the default) or held, outside the scheduler, and
admitted at the wake (`--while-asleep wait`). A sleeping engine never starts a wave.

In a lockstep group a peer can still start one: it took a request just before its own sleep
call arrived, or it woke first. The group's collectives need every rank, so a sleeping rank
pulled into a wave wakes for it (`wake_for_peer`) and sleeps again, at the same level, once
the wave is over: a rare reload, never a hung group."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from parashift.wire import protocol as p
from parashift.wire.engine_calls import EngineCall, IsSleeping, Sleep, WakeUp

logger = logging.getLogger(__name__)

ASLEEP_MESSAGE = "the engines are asleep: POST /wake_up first"


class SleepState:
    def __init__(self, rank: int, core: Any, answer: Callable[[EngineCall, Any], None]):
        """`core`: the EngineCore; `answer(call, result)` replies to a utility call."""
        self.rank, self.core, self.answer = rank, core, answer
        self.level = 0  # 0: awake
        self.released = 0  # bytes the current sleep released (0 awake)
        self.pending: list[Sleep] = []  # sleep calls waiting for the drain
        self.resleep = 0  # woken for a peer's wave: the level to go back to after it
        self.held: dict[str, p.AddRequest] = {}  # --while-asleep wait: admitted at the wake

    @property
    def closed(self) -> bool:
        """Asleep, or going to sleep: new requests are refused or held."""
        return self.level > 0 or bool(self.pending) or self.resleep > 0

    def wake_for_peer(self) -> None:
        """A peer of this rank's group needs it (a lockstep wave) while it sleeps: serve it,
        then sleep again."""
        logger.info("engine dp%d wakes for a peer of its group", self.rank)
        self.core.wake_up()
        self.resleep, self.level, self.released = self.level, 0, 0

    def sleep(self, call: Sleep) -> None:
        """Answered by `settle`, once the engine has drained."""
        if call.level not in (1, 2):
            raise ValueError(f"sleep level {call.level}: use 1 (KV cache) or 2 (and weights)")
        self.pending.append(call)

    def wake_up(self, call: WakeUp) -> None:
        self._answer_pending()  # a wake before the drain ended: nothing was released
        self.resleep = 0
        if self.level:
            self.core.wake_up()
            logger.info("engine dp%d is awake", self.rank)
        self.level = self.released = 0
        self.answer(call, self.state())

    def is_sleeping(self, call: IsSleeping) -> None:
        self.answer(call, self.state())

    def release(self) -> list[p.AddRequest]:
        """The requests held while asleep, in arrival order, after a wake."""
        held, self.held = list(self.held.values()), {}
        return held

    def settle(self, busy: bool) -> None:
        """Sleep now if a call waits and the engine is drained (`busy`: requests or a wave
        still running; held requests are not in the engine yet)."""
        if not self.pending and not self.resleep:
            return
        level = max([call.level for call in self.pending] + [self.resleep])
        if level <= self.level:  # asleep that deep already
            self._answer_pending()
            return
        if busy:
            return
        released = self.core.sleep(level)
        self.level, self.resleep = level, 0
        self.released += released  # level 1, then 2: both releases
        logger.info("engine dp%d sleeps at level %d: %.1f MiB released", self.rank, level,
                    released / 2**20)
        self._answer_pending()

    def state(self) -> dict[str, int]:
        """What every sleep, wake and is_sleeping call answers."""
        return {"level": self.level, "released_bytes": self.released}

    def _answer_pending(self) -> None:
        for call in self.pending:
            self.answer(call, self.state())
        self.pending.clear()
