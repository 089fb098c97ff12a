"""`parashift run --strategy pp2` and `dp2xpp2`: engines whose workers are pipeline stages
(named parashift-worker-dp{d}-pp{s}), driven by the openai client, give pp1's greedy output;
a SIGKILLed stage fails its rank's requests in flight fast while the other rank serves on."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from .servers import LONG_ARGS, TINY_ARGS, running_server
from .test_data_parallel import PROMPTS, ask_all, complete, greedy_texts
from .test_tensor_parallel_serving import worker

pytestmark = pytest.mark.slow


def test_pp2_serves_like_pp1(tiny_llama):
    expected = greedy_texts(tiny_llama)
    with running_server(tiny_llama, *TINY_ARGS, "--strategy", "pp2") as s:
        stages = [worker(s, 0, f"pp{stage}") for stage in (0, 1)]
        assert len({w.pid for w in stages}) == 2
        assert ask_all(s) == expected


def test_dp2xpp2_serves_and_a_dead_stage_fails_only_its_rank_fast(tiny_llama_long):
    expected = greedy_texts(tiny_llama_long)
    with running_server(tiny_llama_long, *LONG_ARGS, "--strategy", "dp2xpp2") as s:
        stages = {(d, p): worker(s, d, f"pp{p}") for d in (0, 1) for p in (0, 1)}
        assert ask_all(s) == expected

        # A long request on dp1, in flight when its last stage dies.
        client = s.client()
        failed: list[float] = []
        first_token = threading.Event()

        def long_request() -> None:
            try:
                stream = client.completions.create(
                    model=s.model_name, prompt=[1, 2, 3], max_tokens=8000, temperature=0,
                    stream=True, extra_body={"ignore_eos": True},
                    extra_headers={"X-data-parallel-rank": "1"})
                for _ in stream:
                    first_token.set()
            except Exception:
                failed.append(time.monotonic())
            first_token.set()

        thread = threading.Thread(target=long_request)
        thread.start()
        assert first_token.wait(60)
        killed = time.monotonic()
        stages[(1, 1)].send_signal(signal.SIGKILL)
        thread.join(30)
        assert not thread.is_alive() and failed, "the request on the dead rank hung"
        assert failed[0] - killed < 10
        deadline = time.monotonic() + 15
        while s.get_json("/health")[0] != 503:
            assert time.monotonic() < deadline, "the dead stage went unnoticed:\n" + s.output()
            time.sleep(0.1)
        assert "dp1" in s.get_json("/health")[1]["detail"]
        for prompt, want in zip(PROMPTS[:6], expected[:6], strict=True):  # dp0 serves on
            assert complete(s, prompt)["choices"][0]["text"] == want


@pytest.mark.extended  # dp2xpp2 is served in the suite, pp2xtp2 runs offline there
def test_dp2xpp2xtp2_serves_like_pp1(tiny_llama):
    expected = greedy_texts(tiny_llama)
    with running_server(tiny_llama, *TINY_ARGS, "--strategy", "dp2xpp2xtp2") as s:
        workers = [worker(s, d, f"pp{p}", f"tp{t}") for d in (0, 1) for p in (0, 1)
                   for t in (0, 1)]
        assert len({w.pid for w in workers}) == 8
        assert ask_all(s) == expected
