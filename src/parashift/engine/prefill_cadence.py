"""Prefill cadence for a lockstep group (--prefill-schedule-interval N, vLLM's name), torch-free.

Every rank of the group runs every step, so a step takes as long as its slowest rank's: one
rank's prefill stalls every rank's decodes. With N > 1 the ranks take new prefill work (new
requests, and the chunks of prompts already running) only on the steps of a wave that are
multiples of N, so the prefills of all ranks land on the same steps and the steps between are
decode only. Decodes always run.

The decision is the same on every rank without a message of its own: the wave's step count is
the same on all (they take the wave's steps together), and what decides the rest travels in
each step's first collective (the token counts' exchange, distributed/expert_dispatch.py):
whether any rank is saturated, i.e. its last step that admitted prefill work left requests
waiting. Then every rank admits on every step until none is (a held prefill would only pile
up), as vLLM's capacity guard does."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PrefillCadence:
    interval: int = 1
    step: int = 0  # steps of the current wave taken
    saturated: bool = False  # this rank: its last admitting step left requests waiting
    group_saturated: bool = False  # any rank of the group, as of the last step
    num_held_steps: int = 0  # steps that held prefill work back (since the engine started)

    def admits(self) -> bool:
        """Whether this step may take prefill work (the same answer on every rank)."""
        return self.interval <= 1 or self.group_saturated or self.step % self.interval == 0

    def scheduled(self, admitted: bool, num_waiting: int, held: bool) -> None:
        """After this rank scheduled the step: `admitted`, whether it might take prefill work;
        `num_waiting`, the requests it left waiting; `held`, whether it held any back."""
        if admitted:
            self.saturated = num_waiting > 0
        self.num_held_steps += held

    def stepped(self, group_saturated: bool, group_has_work: bool) -> None:
        """After the step, from its first collective: the group's saturation, and whether the
        wave goes on (a wave's end starts the count again)."""
        self.group_saturated = group_saturated
        self.step = self.step + 1 if group_has_work else 0
