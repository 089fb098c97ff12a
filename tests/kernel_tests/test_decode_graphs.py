"""The CUDA-graph decode path's bookkeeping, on CPU: what is captured, which steps replay,
and that a replay on the static, padded buffers gives the eager step's hidden states (the
"graph" here replays the captured forward eagerly, under Triton's interpreter; real capture
needs a GPU: scripts/gpu_check.sh)."""

import pytest
import torch

from parashift.engine.llm import LLM
from parashift.executor.cuda_graphs import DecodeGraphs, capture_sizes, padded_size
from parashift.types.sampling_params import SamplingParams


def test_capture_sizes_and_padding():
    assert capture_sizes(1) == [1]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    sizes = capture_sizes(20)
    assert [padded_size(sizes, n) for n in (1, 3, 16, 17, 20, 21)] == [1, 4, 16, 20, 20, None]


class EagerReplay:
    """Stands in for torch.cuda.CUDAGraph: replay() runs the forward on the static buffers."""

    def __init__(self, graphs: DecodeGraphs, size: int):
        self.graphs, self.size = graphs, size

    def replay(self) -> None:
        g, n = self.graphs, self.size
        g.outputs[n] = g.model(g.input_ids[:n], g.positions[:n], g._metadata(n))


def generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids
            for o in llm.generate(prompts, params,
                                  use_tqdm=False)]


def eager_graphs(llm: LLM, max_num_seqs: int, max_model_len: int
                 ) -> tuple[DecodeGraphs, list[int]]:
    """Graphs up to `max_num_seqs` that replay eagerly, put in the runner's hands, and the
    batch size of every replay."""
    runner = llm.engine.executor.worker.runner
    graphs = DecodeGraphs(runner.model, max_num_seqs, max_model_len, runner.block_size,
                          runner.device)
    graphs.graphs = {n: EagerReplay(graphs, n) for n in graphs.sizes}
    replays: list[int] = []
    run = graphs.run
    graphs.run = lambda ids, pos, step: replays.append(len(ids)) or run(ids, pos, step)
    runner.graphs = graphs
    return graphs, replays


@pytest.mark.parametrize("num_prompts", [3, 5])  # padded to 4, and to 8 of max_num_seqs 8
def test_a_replay_on_padded_buffers_equals_the_eager_step(tiny_llama, num_prompts):
    prompts = [[(7 * i + j) % 250 + 1 for j in range(5 + 9 * i)] for i in range(num_prompts)]
    llm = LLM(tiny_llama, dtype="float32", attention_backend="triton", max_num_seqs=8,
              max_model_len=128, kv_cache_memory=8 * 2**20)
    want = generate(llm, prompts)
    graphs, replays = eager_graphs(llm, 8, 128)
    # stale contents in the static buffers must not leak into a smaller batch
    graphs.block_table.fill_(3)
    graphs.seq_lens.fill_(50)
    assert generate(llm, prompts) == want
    assert replays and set(replays) == {num_prompts}  # every decode step, no prefill step
    assert torch.all(graphs.slot_mapping[num_prompts:] == -1)


def test_a_batch_past_the_largest_graph_runs_eagerly(tiny_llama):
    """Graphs captured up to 4 sequences, a decode batch of 5: no replay, the eager step's
    tokens (the scheduler's --max-num-seqs can exceed what was captured)."""
    prompts = [[(5 * i + j) % 250 + 1 for j in range(4 + 3 * i)] for i in range(5)]
    llm = LLM(tiny_llama, dtype="float32", attention_backend="triton", max_num_seqs=8,
              max_model_len=64, kv_cache_memory=4 * 2**20)
    want = generate(llm, prompts)
    _, replays = eager_graphs(llm, 4, 64)
    assert generate(llm, prompts) == want
    assert replays == []
