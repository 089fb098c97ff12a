"""The prefill cadence of a lockstep group (engine/prefill_cadence.py), over real schedulers:
two ranks step together as a wave does, each deciding alone from what every step's first
collective tells all of them (whether any rank is saturated, whether the wave goes on). Their
decisions agree on every step; with N = 2 prefill work (new requests, and the chunks of a
prompt already running) lands only on the wave's even steps while decodes run on every step;
a rank that cannot admit what waits opens every step for the whole group; N = 1 never holds."""

from __future__ import annotations

from parashift.engine.prefill_cadence import PrefillCadence
from parashift.engine.scheduler import Scheduler

from .test_scheduler import FakeRunner, make_request, make_scheduler


class Rank:
    def __init__(self, interval: int, **limits) -> None:
        self.sched: Scheduler = make_scheduler(num_blocks=64, **limits)
        self.runner = FakeRunner()
        self.cadence = PrefillCadence(interval)
        self.out = None

    def schedule(self) -> bool:
        """This rank's half of a step before the collective: whether it admitted."""
        sched, cadence = self.sched, self.cadence
        sched.admits_prefill = admitted = cadence.admits()
        self.out = sched.schedule()
        cadence.scheduled(admitted, len(sched.waiting),
                          not admitted and sched.has_prefill_work())
        return admitted

    def prefill_tokens(self) -> int:
        """Tokens of this step that are prompt chunks, not decodes."""
        return sum(n for n in self.out.num_scheduled_tokens.values() if n > 1) + sum(
            1 for r in self.out.new_reqs if r.num_computed_tokens == 0 and
            self.out.num_scheduled_tokens[r.req_id] == 1)


def step_group(ranks: list[Rank]) -> list[bool]:
    """One lockstep step: every rank schedules, the collective's answers reach all."""
    admitted = [rank.schedule() for rank in ranks]
    group_saturated = any(rank.cadence.saturated for rank in ranks)
    group_has_work = any(rank.sched.has_unfinished_requests for rank in ranks)
    for rank in ranks:
        rank.sched.update_from_output(rank.out, rank.runner.execute(rank.sched, rank.out))
        rank.cadence.stepped(group_saturated, group_has_work)
    return admitted


def test_with_n_2_prefills_land_on_the_same_even_steps_and_decodes_run_on_every_step():
    ranks = [Rank(2, max_num_batched_tokens=8), Rank(2, max_num_batched_tokens=8)]
    ranks[0].sched.add_request(make_request("long", prompt_len=20, max_tokens=12))
    ranks[1].sched.add_request(make_request("short", prompt_len=3, max_tokens=12))
    arrivals = {3: (1, "late-odd"), 6: (0, "late-even")}  # step -> (rank, request)
    history = []
    for step in range(40):
        if step in arrivals:
            rank, name = arrivals[step]
            ranks[rank].sched.add_request(make_request(name, prompt_len=5, max_tokens=3))
        admitted = step_group(ranks)
        assert admitted[0] == admitted[1]  # decided alone, the same on both
        history.append((admitted[0], [r.prefill_tokens() for r in ranks],
                        set(ranks[1].out.num_scheduled_tokens)))
        if not any(r.sched.has_unfinished_requests for r in ranks):
            break
    for step, (admitted, prefill, _) in enumerate(history):
        assert admitted == (step % 2 == 0), step  # nothing saturates here
        if not admitted:
            assert prefill == [0, 0], (step, prefill)
    # The long prompt's chunks (8, 8, 4) ran on steps 0, 2, 4; "short" decoded meanwhile.
    assert [p[0] for _, p, _ in history[:5]] == [8, 0, 8, 0, 4]
    assert all("short" in names for _, _, names in history[1:12])  # a decode every step
    # The request that came at step 3 waited for step 4; the one at step 6 went at once.
    assert history[3][1][1] == 0 and history[4][1][1] == 5 and history[6][1][0] == 5
    assert ranks[0].cadence.num_held_steps > 0
    for rank in ranks:
        assert not rank.sched.has_unfinished_requests


def test_a_saturated_rank_opens_every_step_for_the_group_until_it_drains():
    """Rank 0 can run one request at a time: an admitting step leaves the others waiting, so
    every rank admits on the next step too (held prefills would only pile up)."""
    ranks = [Rank(2, max_num_seqs=1), Rank(2)]
    for i in range(3):
        ranks[0].sched.add_request(make_request(f"queued{i}", prompt_len=4, max_tokens=2))
    ranks[1].sched.add_request(make_request("other", prompt_len=4, max_tokens=8))
    admitted = [step_group(ranks)[0] for _ in range(6)]
    # step 0 admits and leaves two waiting: saturated, so steps 1.. admit while any waits
    assert admitted[:4] == [True, True, True, True]
    late = make_request("late", prompt_len=4, max_tokens=2)
    while any(r.sched.has_unfinished_requests for r in ranks):
        step_group(ranks)
    assert not ranks[0].cadence.saturated and not ranks[0].cadence.group_saturated
    ranks[1].sched.add_request(late)  # a new wave: step 0 admits, and N = 2 holds again
    assert [step_group(ranks)[0] for _ in range(3)] == [True, False, True]


def test_n_1_admits_on_every_step_and_never_holds():
    ranks = [Rank(1, max_num_batched_tokens=4), Rank(1)]
    ranks[0].sched.add_request(make_request("a", prompt_len=10, max_tokens=4))
    ranks[1].sched.add_request(make_request("b", prompt_len=3, max_tokens=6))
    while any(r.sched.has_unfinished_requests for r in ranks):
        assert step_group(ranks) == [True, True]
    assert [r.cadence.num_held_steps for r in ranks] == [0, 0]
