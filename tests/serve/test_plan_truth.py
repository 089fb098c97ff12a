"""Plan truth, served: `plan --json` predicts the KV blocks and weight bytes per worker that
every engine of a dp2xtp3 server reports in its READY."""

from __future__ import annotations

import ast
import re

import pytest
from conftest import plan_json, predicted

from .servers import running_server


@pytest.mark.slow
def test_tiny_model_served_dp2xtp3(tiny_split_by_3):
    model = tiny_split_by_3
    flags = ["--kv-cache-memory", "64MiB"]  # 6 workers at once: keep their caches small
    blocks, weights = predicted(plan_json(model, "dp2xtp3", *flags))
    with running_server(model, "--strategy", "dp2xtp3", *flags) as server:
        log = server.output()
    ready = re.findall(r"engine dp(\d) ready: (\d+) KV blocks .* weight bytes per worker "
                       r"(\[[\d, ]+\])", log)
    assert sorted(r for r, _, _ in ready) == ["0", "1"], log[-3000:]
    for _, engine_blocks, engine_weights in ready:
        assert int(engine_blocks) == blocks
        assert ast.literal_eval(engine_weights) == [weights] * 3
