"""worker_extension_cls: a class mixed into every worker (its methods answer collective_rpc),
as the studies in scripts/ measure from outside the product; a bad name is an error naming
it."""

from __future__ import annotations

import dataclasses

import pytest

from parashift.engine.args import EngineArgs, create_config
from parashift.executor.worker import Worker, worker_class


def test_no_extension_is_the_plain_worker(tiny_llama):
    assert worker_class(create_config(EngineArgs(tiny_llama))) is Worker


def test_an_extension_is_mixed_in_before_the_worker(tiny_llama):
    config = create_config(EngineArgs(tiny_llama, worker_extension_cls="study_probes.StudyProbes"))
    cls = worker_class(config)
    assert issubclass(cls, Worker) and cls.__mro__[1].__name__ == "StudyProbes"
    assert hasattr(cls, "take_comm_stats") and not hasattr(Worker, "take_comm_stats")


@pytest.mark.parametrize("name", ["no_such_module.Probe", "study_probes.NoSuchClass", "x"])
def test_a_bad_extension_names_itself(tiny_llama, name):
    config = dataclasses.replace(create_config(EngineArgs(tiny_llama)), worker_extension_cls=name)
    with pytest.raises(ValueError, match=f"worker_extension_cls '{name}'"):
        worker_class(config)
