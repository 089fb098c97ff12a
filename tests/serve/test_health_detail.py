"""/health names a dead rank's state, never its reason: an engine's reason is the last line of
its traceback, which may quote a request; the API server's log keeps it. Torch-free: a real
engine client, no engines."""

import logging

from parashift.serve.engine_client import EngineClient
from parashift.wire import protocol as p

SECRET = "ValueError: the prompt 'my bank password is hunter2' broke the sampler"


def test_health_names_the_dead_rank_without_its_traceback(tmp_path, caplog):
    broker = EngineClient(0, f"ipc://{tmp_path}/requests", f"ipc://{tmp_path}/outputs", 2)
    try:
        assert broker.health() == (False, "engine(s) dp0, dp1 not ready yet")
        assert broker.ranks.states() == {"dp0": "starting", "dp1": "starting"}
        for rank in (0, 1):
            broker.on_ready(p.EngineReady(rank, 256, 100, 1000 + rank, 16), str(rank).encode())
        assert broker.health() == (True, "ok")
        assert broker.ranks.states() == {"dp0": "serving", "dp1": "serving"}
        with caplog.at_level(logging.ERROR):
            broker.mark_dead(1, SECRET)
        assert broker.ranks.states() == {"dp0": "serving", "dp1": "dead"}
        ok, detail = broker.health()
        assert not ok and "dp1" in detail.split() and "down" in detail
        assert "hunter2" not in detail and "ValueError" not in detail
        assert SECRET in caplog.text  # the operator still learns why
    finally:
        broker.ctx.destroy(linger=0)
