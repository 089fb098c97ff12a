"""An engine's sleep state machine over a real engine core (tiny model): a sleep call waits
for the drain, a rank pulled into a peer's wave wakes for it and sleeps again at its level
once the wave is over, and an explicit wake ends all of it."""

from parashift import LLM, SamplingParams
from parashift.engine.sleep_state import SleepState
from parashift.wire import engine_calls as calls


def test_sleep_waits_for_the_drain_and_a_wave_wakes_a_sleeping_rank(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", max_model_len=128, kv_cache_memory=8 << 20)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    want = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids
    worker = llm.engine.executor.worker
    answers: list[tuple[str, dict]] = []
    state = SleepState(0, llm.engine, lambda call, result: answers.append((type(call).__name__,
                                                                          result)))
    state.sleep(calls.Sleep(1, 0, 2))
    assert state.closed and not answers
    state.settle(busy=True)  # a request or a wave still runs: not yet
    assert state.level == 0 and not answers
    state.settle(busy=False)
    assert state.level == 2 and worker.model is None
    assert answers[-1][0] == "Sleep" and answers[-1][1]["released_bytes"] > 0

    state.wake_for_peer()  # a peer started a wave
    assert state.level == 0 and state.closed and worker.model is not None
    state.settle(busy=True)  # the wave runs
    assert state.level == 0
    state.settle(busy=False)  # over: back to sleep, with no call to answer
    assert state.level == 2 and len(answers) == 1
    released = state.released
    assert released > 0
    state.sleep(calls.Sleep(3, 0, 1))  # asleep deeper already
    state.settle(busy=False)
    assert answers[-1] == ("Sleep", {"level": 2, "released_bytes": released})

    state.wake_up(calls.WakeUp(2, 0))
    assert state.level == 0 and not state.closed
    assert answers[-1] == ("WakeUp", {"level": 0, "released_bytes": 0})
    assert llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids == want
    llm.shutdown()
