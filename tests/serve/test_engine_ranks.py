"""An API server's view of each rank (serve/engine_ranks.py): STARTING until its EngineReady,
SERVING, DEAD on its death, SERVING again with a new incarnation's EngineReady; a rank the
launch does not have changes nothing."""

from parashift.serve.engine_ranks import EngineRanks, RankStatus
from parashift.wire import protocol as p


def test_a_rank_starts_serves_dies_and_comes_back():
    ranks = EngineRanks(2)
    assert ranks.starting() == [0, 1] and ranks.serving() == [] and not ranks.ever_ready()
    assert ranks.on_ready(p.EngineReady(1, 256, 100, 7)) == RankStatus.STARTING
    assert ranks.serving() == [1] and ranks.starting() == [0]
    ranks.on_dead(1, "killed")
    assert ranks.is_dead(1) and ranks.dead() == {1: "killed"} and ranks.serving() == []
    assert ranks.ever_ready()[1].incarnation == 7  # its last incarnation, for late news
    assert ranks.on_ready(p.EngineReady(1, 256, 100, 8)) == RankStatus.DEAD
    assert ranks.serving() == [1] and ranks.dead() == {}
    assert ranks.ever_ready()[1].incarnation == 8


def test_a_rank_outside_the_launch_changes_nothing():
    ranks = EngineRanks(1)
    assert ranks.on_ready(p.EngineReady(5, 256, 100)) is None
    ranks.on_dead(5, "?")
    assert not ranks.is_dead(5) and ranks.serving() == [] and ranks.starting() == [0]
