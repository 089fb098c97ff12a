"""Turns a scheduler step into one flat, unpadded batch, runs the model, samples. Its copy of
the running requests, kept from the scheduler's deltas: executor/request_states.py."""

from __future__ import annotations

import contextlib

import numpy as np
import torch
from torch import nn
from torch.profiler import record_function

from parashift.distributed.communicator import GroupCommunicator
from parashift.executor.cuda_graphs import DecodeGraphs
from parashift.executor.fused_cpu_layers import FusedCpuLayers
from parashift.executor.request_states import RequestState, RequestStates
from parashift.layers.attention.backend import AttentionBackend, AttentionStepInputs
from parashift.layers.penalties import PenaltyInputs
from parashift.layers.sampler import Sampler, SamplingMetadata, position_seed, row_uniforms
from parashift.layers.token_mask import apply_token_bitmask
from parashift.types.outputs import (
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    WaveStepOutput,
)
from parashift.types.sampling_params import SamplingParams


class ModelRunner:
    """`pp`: the pipeline group. A stage after the first receives the previous stage's hidden
    states and residual; a stage before the last sends its own on and samples nothing."""

    def __init__(self, model: nn.Module, backend: AttentionBackend, block_size: int,
                 device: torch.device, pp: GroupCommunicator | None = None):
        self.model = model
        self.pp = pp or GroupCommunicator()
        self.backend = backend
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler()
        self.requests = RequestStates()
        self.vocab_size: int = model.config.vocab_size
        # MoE over several engines: every step starts with the group's token-count exchange.
        dispatcher = getattr(model, "dispatcher", None)
        self.dispatcher = dispatcher if dispatcher is not None and dispatcher.is_active else None
        self.graphs: DecodeGraphs | None = None  # CUDA graphs for decode steps, once captured

    def capture_decode_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """After the KV cache is bound. Only a whole model on one device (no pipeline or
        expert-parallel collectives inside the captured forward)."""
        assert self.pp.world_size == 1 and self.dispatcher is None
        self.graphs = DecodeGraphs(self.model, max_num_seqs, max_model_len, self.block_size,
                                   self.device)
        self.graphs.capture()

    def bind_kv_cache(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The fused CPU layers hold raw pointers to the cache and the packed weights: made
        again each time the cache is bound (after a sleep, too)."""
        self.model.bind_kv_cache(kv_caches)
        self.model.fused_layers = FusedCpuLayers.for_model(self.model)

    def profile_run(self, num_tokens: int) -> None:
        """One prefill of `num_tokens` dummy tokens: the largest step the scheduler can send."""
        blocks = list(range(-(-num_tokens // self.block_size)))
        request = NewRequestData("profile", [0] * num_tokens, num_tokens,
                                 SamplingParams(max_tokens=1), blocks, 0)
        self.execute_model(SchedulerOutput([request], [], {"profile": num_tokens}, num_tokens,
                                           set()))
        del self.requests["profile"]

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        if self.dispatcher is not None:  # its collectives need the step's count exchange
            return self.execute_wave_step(out, has_work=False).output
        self.requests.apply(out)
        return self._run(out) if not out.is_empty else ModelRunnerOutput({})

    @torch.inference_mode()
    def execute_wave_step(self, out: SchedulerOutput, has_work: bool) -> WaveStepOutput:
        """Lockstep: every engine comes here every step of a wave, with work or without;
        `has_work`: whether this engine still has requests."""
        self.requests.apply(out)
        comm = self.dispatcher.ep.stats
        waited = comm.seconds
        group_has_work = self.dispatcher.begin_step(out.total_num_scheduled_tokens, has_work)
        if not out.is_empty:
            result = self._run(out)
        else:  # a dummy step: our experts still serve the other engines' tokens
            if self.dispatcher.max_tokens:
                self._forward_no_tokens()
            result = ModelRunnerOutput({})
        return WaveStepOutput(result, group_has_work, comm.seconds - waited)

    def _forward_no_tokens(self) -> None:
        empty = np.zeros(0, dtype=np.int64)
        step = AttentionStepInputs(
            query_start_loc=np.zeros(1, dtype=np.int64), seq_lens=empty,
            num_computed_tokens=empty, block_table=np.zeros((0, 1), dtype=np.int64),
            slot_mapping=torch.zeros(0, dtype=torch.long, device=self.device), num_decodes=0,
            block_size=self.block_size, sliding_window=None, device=self.device)
        no_tokens = torch.zeros(0, dtype=torch.long, device=self.device)
        self.model(no_tokens, no_tokens, self.backend.build_metadata(step))

    def _run(self, out: SchedulerOutput) -> ModelRunnerOutput:
        # Decodes (one query token) first: the attention backend batches them together.
        order = sorted(out.num_scheduled_tokens, key=lambda r: out.num_scheduled_tokens[r] > 1)
        states = [self.requests[r] for r in order]
        q_lens = np.array([out.num_scheduled_tokens[r] for r in order], dtype=np.int64)
        starts = np.array([s.num_computed_tokens for s in states], dtype=np.int64)
        input_ids, positions, step = self._prepare_inputs(states, q_lens, starts)
        if self.graphs is not None and self.graphs.can_run(step):
            hidden = self.graphs.run(input_ids, positions, step)
        else:
            hidden = self._forward_stage(input_ids, positions, self.backend.build_metadata(step))
        sample_rows = self.requests.advance(states, q_lens)
        if hidden is None or not sample_rows:  # a stage before the last
            return ModelRunnerOutput({})
        last_token = torch.from_numpy(step.query_start_loc[1:][sample_rows] - 1).to(self.device)
        logits = self.model.compute_logits(hidden.index_select(0, last_token))
        if logits is None:  # not the output rank
            return ModelRunnerOutput({})
        sampled_states = [states[i] for i in sample_rows]
        req_ids = [order[i] for i in sample_rows]
        if out.grammar is not None:  # structured outputs: their rows' allowed tokens
            where = {r: i for i, r in enumerate(req_ids)}
            with (record_function("parashift::grammar") if torch.autograd._profiler_enabled()
                  else contextlib.nullcontext()):
                apply_token_bitmask(logits, [where.get(r) for r in out.grammar.req_ids],
                                    out.grammar.bits, out.grammar.words)
        # The label is for `bench latency --breakdown`; it costs ~7 us a step otherwise.
        with (record_function("parashift::sample") if torch.autograd._profiler_enabled()
              else contextlib.nullcontext()):
            md = sampling_metadata(sampled_states, self.vocab_size, self.device)
            tokens, logprobs = self.sampler(logits, md)
        has_logprobs = any(lp is not None for lp in logprobs)
        return ModelRunnerOutput(
            dict(zip(req_ids, tokens, strict=True)),
            {r: lp for r, lp in zip(req_ids, logprobs, strict=True) if lp is not None}
            if has_logprobs else None,
        )

    def _forward_stage(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       metadata) -> torch.Tensor | None:
        """This stage's layers: final hidden states on the last stage, None on the others
        (which send theirs on)."""
        model = self.model
        intermediate = None
        if not model.has_embedding:  # [2, num_tokens, hidden]: hidden states and residual
            received = self.pp.recv_prev((2, input_ids.shape[0], model.config.hidden_size),
                                         model.dtype, self.device)
            intermediate = (received[0], received[1])
        out = model(input_ids, positions, metadata, intermediate)
        if not model.is_last_stage:
            self.pp.send_next(torch.stack(out))
            out = None
        return out

    def _prepare_inputs(self, states: list[RequestState], q_lens: np.ndarray,
                        starts: np.ndarray):
        bs = self.block_size
        cu = np.zeros(len(states) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu[1:])
        num_tokens = int(cu[-1])
        positions = np.repeat(starts - cu[:-1], q_lens) + np.arange(num_tokens)
        input_ids: list[int] = []
        for state, start, q_len in zip(states, starts.tolist(), q_lens.tolist(), strict=True):
            input_ids.extend(state.token_ids[start : start + q_len])
        max_blocks = max(len(s.block_ids) for s in states)
        block_table = np.zeros((len(states), max_blocks), dtype=np.int64)
        for i, state in enumerate(states):
            block_table[i, : len(state.block_ids)] = state.block_ids
        rows = np.repeat(np.arange(len(states)), q_lens)
        slot_mapping = block_table[rows, positions // bs] * bs + positions % bs
        num_decodes = int(np.searchsorted(q_lens > 1, True))
        step = AttentionStepInputs(
            query_start_loc=cu,
            seq_lens=starts + q_lens,
            num_computed_tokens=starts,
            block_table=block_table,
            slot_mapping=torch.from_numpy(slot_mapping).to(self.device),
            num_decodes=num_decodes,
            block_size=bs,
            sliding_window=getattr(self.model, "sliding_window", None),
            device=self.device,
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        return ids, torch.from_numpy(positions).to(self.device), step


def sampling_metadata(states: list[RequestState], vocab_size: int,
                      device: torch.device) -> SamplingMetadata:
    """The sampler's view of a step's sampling rows."""
    params = [s.params for s in states]

    def column(values, dtype):
        return torch.tensor(values, dtype=dtype, device=device)

    greedy = [p.is_greedy for p in params]
    all_greedy = all(greedy)
    sampled = [p for p, g in zip(params, greedy, strict=True) if not g]
    seeds = {
        i: position_seed(p.seed, len(s.token_ids) - s.num_prompt_tokens)
        for i, (s, p) in enumerate(zip(states, params, strict=True))
        if p.seed is not None and not greedy[i]
    }
    penalties = None
    if any(s.counts is not None for s in states):
        penalties = PenaltyInputs.gather(
            [s.counts for s in states], [p.repetition_penalty for p in params],
            [p.frequency_penalty for p in params], [p.presence_penalty for p in params],
            device)
    # A filter's column exists only when a sampled row uses it: neutral values cost nothing.
    return SamplingMetadata(
        temperature=column([0.0 if g else p.temperature
                            for p, g in zip(params, greedy, strict=True)], torch.float32),
        all_greedy=all_greedy,
        top_k=column([max(p.top_k, 0) for p in params], torch.int64)
        if any(0 < p.top_k < vocab_size for p in sampled) else None,
        top_p=column([p.top_p for p in params], torch.float32)
        if any(p.top_p < 1.0 for p in sampled) else None,
        min_p=column([p.min_p for p in params], torch.float32)
        if any(p.min_p > 0.0 for p in sampled) else None,
        uniforms=None if all_greedy else row_uniforms(len(states), seeds, device),
        penalties=penalties,
        num_logprobs=[p.logprobs for p in params],
    )
