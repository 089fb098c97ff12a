"""The per-step token budget's default: 512 tokens on CPU, 2048 on a GPU, never below
--max-num-seqs nor, without chunked prefill, --max-model-len; an explicit
--max-num-batched-tokens wins."""

from __future__ import annotations

from parashift.defaults import default_max_num_batched_tokens
from parashift.engine.args import EngineArgs, create_config


def budget(model: str, **kwargs) -> int:
    return create_config(EngineArgs(model=model, **kwargs)).scheduler.max_num_batched_tokens


def test_cpu_steps_hold_512_tokens_unless_told(tiny_llama):
    assert budget(tiny_llama, device="cpu") == 512
    assert budget(tiny_llama, device="cpu", max_num_seqs=600) == 600
    assert budget(tiny_llama, device="cpu", max_num_batched_tokens=4096) == 4096
    # without chunked prefill a step holds a whole prompt
    assert budget(tiny_llama, device="cpu", enable_chunked_prefill=False,
                  max_model_len=1024) == 1024


def test_gpu_steps_hold_2048_tokens():
    assert default_max_num_batched_tokens(128, "cuda") == 2048
    assert default_max_num_batched_tokens(4096, "cuda:1") == 4096
    assert default_max_num_batched_tokens(128, "cpu") == 512
