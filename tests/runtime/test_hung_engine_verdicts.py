"""A hung-engine verdict names the process that went silent: the launcher kills that process,
never a newer incarnation of the same rank that is still loading (the group-restart race)."""

import multiprocessing
import signal
import time

import zmq

from parashift.runtime.local_engines import LocalEngines
from parashift.runtime.lockstep_group import LockstepGroup
from parashift.wire import protocol as p


def test_the_group_reads_each_verdicts_rank_and_incarnation():
    ctx = zmq.Context()
    try:
        publish = ctx.socket(zmq.PUB)
        port = publish.bind_to_random_port("tcp://127.0.0.1")
        group = LockstepGroup(2)
        group.watch(ctx, f"tcp://127.0.0.1:{port}")
        verdicts: list[tuple[int, int]] = []
        deadline = time.monotonic() + 10
        while not verdicts and time.monotonic() < deadline:  # until the subscription is up
            publish.send(p.encode(p.EngineDead(1, "no heartbeat for 2 s", 4242)))
            publish.send(p.encode(p.EngineDead(7, "no such rank in a group of 2", 99)))
            time.sleep(0.05)
            verdicts = list(group.hung_ranks())
        assert verdicts and set(verdicts) == {(1, 4242)}
    finally:
        ctx.destroy(linger=0)


def test_a_verdict_about_an_earlier_process_of_the_rank_kills_nothing():
    """The stale verdict sends no signal: the process then dies of the SIGTERM the test sends
    it, not of a SIGKILL (which, once sent, would be how it ends whatever came after). The
    verdict that names the running process kills it."""
    engines = LocalEngines({}, "ipc:///nowhere", "info", 10.0)
    spawn = multiprocessing.get_context("spawn")
    procs = [spawn.Process(target=time.sleep, args=(60,)) for _ in range(2)]
    for proc in procs:
        proc.start()
    try:
        first, second = procs
        engines.procs[0] = second  # the rank's process now; `first` had the rank before
        engines.kill(0, first.pid)  # the verdict about the earlier incarnation
        second.terminate()
        second.join(30)
        assert second.exitcode == -signal.SIGTERM
        engines.procs[0] = first  # a verdict that names the rank's running process
        engines.kill(0, first.pid)
        first.join(30)
        assert first.exitcode == -signal.SIGKILL
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
