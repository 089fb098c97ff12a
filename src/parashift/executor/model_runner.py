"""Turns a scheduler step into one flat, unpadded batch, runs the model, samples. Its rows of
the running requests, kept from the scheduler's deltas: executor/input_batch.py. A step's
result says which of three cases it is (executor/step_result.py).

A step whose structured-output mask waits for tokens still in flight (async scheduling) runs
its forward and logits in `execute_model`, which returns DEFERRED, and samples in
`sample_tokens(mask)` once the engine has made the mask.

With placeholders (async scheduling) the sampled ids stay on the device: the next step's
inputs copy its placeholders from them there, and the output's ids come to the host without a
wait (executor/sampled_tokens.py)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from parashift.distributed.communicator import GroupCommunicator
from parashift.executor.cuda_graphs import DecodeGraphs
from parashift.executor.fused_cpu_layers import FusedCpuLayers
from parashift.executor.input_batch import InputBatch
from parashift.executor.sampled_tokens import (
    AsyncModelRunnerOutput,
    SampledTokens,
    runner_output,
)
from parashift.executor.sampling_inputs import sampling_metadata
from parashift.executor.step_result import (
    DEFERRED,
    NOT_OUTPUT_RANK,
    Sampled,
    StepResult,
    nothing_sampled,
)
from parashift.layers.attention.backend import AttentionBackend, AttentionStepInputs
from parashift.layers.host_to_device import to_device
from parashift.layers.profiling import DeviceTimer, profiler_label
from parashift.layers.sampler import Sampler, SamplingMetadata
from parashift.layers.token_mask import apply_token_bitmask
from parashift.types.outputs import GrammarBitmask, NewRequestData, SchedulerOutput
from parashift.types.sampling_params import SamplingParams


@dataclass
class _Unsampled:
    """A step's logits waiting for their mask."""

    logits: torch.Tensor  # [num_rows, vocab]
    rows: np.ndarray  # the batch rows that sample
    req_ids: list[str]


_UNTIMED = contextlib.nullcontext()


class ModelRunner:
    """`pp`: the pipeline group. A stage after the first receives the previous stage's hidden
    states and residual; a stage before the last sends its own on and samples nothing.
    `placeholders`: async scheduling's steps read tokens not yet sampled when they were
    scheduled. `output_rank`: this rank answers for the step (the last stage's tp rank 0)."""

    def __init__(self, model: nn.Module, backend: AttentionBackend, block_size: int,
                 device: torch.device, max_model_len: int,
                 pp: GroupCommunicator | None = None,
                 share_sampled: GroupCommunicator | None = None, placeholders: bool = False,
                 output_rank: bool = True):
        self.model = model
        self.pp = pp or GroupCommunicator()
        # Async scheduling under tensor parallel: the tp ranks that do not sample need the
        # sampled ids for the placeholders of the step after (rank 0 broadcasts them).
        self.share_sampled = share_sampled
        self.placeholders = placeholders
        self._sampled: SampledTokens | None = None  # what the batch's pending rows index
        self.backend = backend
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler()
        self.batch = InputBatch(max_model_len, block_size)
        self._unsampled: _Unsampled | None = None
        self._sampling_cache: tuple[tuple[int, bytes], SamplingMetadata] | None = None
        self.vocab_size: int = model.config.vocab_size
        self.output_rank = output_rank
        # MoE over several ranks: every step starts with the group's token-count exchange.
        dispatcher = getattr(model, "dispatcher", None)
        self.dispatcher = dispatcher if dispatcher is not None and dispatcher.is_active else None
        self.graphs: DecodeGraphs | None = None  # CUDA graphs for decode steps, once captured
        # Set by `bench latency --breakdown`: the seconds of the forward, logits and sampler.
        self.device_timer: DeviceTimer | None = None

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
        self.batch.remove("profile")

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> StepResult:
        """One step. (A lockstep group's steps come through executor/lockstep_worker.py.)"""
        self.batch.apply(out)
        if self.dispatcher is not None:  # every rank of the expert group takes this step
            self.dispatcher.begin_step(out.total_num_scheduled_tokens, has_work=False)
        return self.run_applied(out)

    def run_applied(self, out: SchedulerOutput) -> StepResult:
        """The step, its changes already applied to the batch."""
        if out.is_empty:  # (never deferred: a deferred mask has rows that sample)
            return self._no_samples()
        return self._run(out)

    @torch.inference_mode()
    def sample_tokens(self, grammar: GrammarBitmask | None) -> StepResult:
        """The deferred step's sampling, with its mask."""
        pending, self._unsampled = self._unsampled, None
        if pending is None:
            return self._no_samples()
        return self._sample(pending.logits, pending.rows, pending.req_ids, grammar)

    def _no_samples(self) -> StepResult:  # a step where no row samples
        return nothing_sampled() if self.output_rank else NOT_OUTPUT_RANK

    def _timed(self) -> contextlib.AbstractContextManager:
        timer = self.device_timer
        return _UNTIMED if timer is None else timer.timed()

    @torch.inference_mode()
    def forward_no_tokens(self) -> None:
        """A forward of no tokens: a lockstep rank without work still serves its experts to
        the group's other ranks."""
        empty = np.zeros(0, dtype=np.int64)
        step = AttentionStepInputs(
            query_start_loc=np.zeros(1, dtype=np.int64), seq_lens=empty,
            num_computed_tokens=empty, block_table=np.zeros((0, 1), dtype=np.int64),
            slot_mapping=torch.zeros(0, dtype=torch.long, device=self.device), num_decodes=0,
            block_size=self.block_size, sliding_window=None, device=self.device)
        no_tokens = torch.zeros(0, dtype=torch.long, device=self.device)
        self.model(no_tokens, no_tokens, self.backend.build_metadata(step))

    def _run(self, out: SchedulerOutput) -> StepResult:
        batch = self.batch
        scheduled = out.num_scheduled_tokens
        req_ids = list(scheduled)
        rows = batch.rows_of(req_ids)
        if out.total_num_scheduled_tokens == len(req_ids):  # decodes only
            q_lens = np.ones(len(req_ids), dtype=np.int64)
        else:  # decodes (one query token) first: the attention backend
            q_lens = np.fromiter(scheduled.values(), dtype=np.int64, count=len(req_ids))
            order = np.argsort(q_lens > 1, kind="stable")  # batches them together
            q_lens, rows = q_lens[order], rows[order]
            req_ids = [req_ids[i] for i in order.tolist()]
        input_ids, positions, step = self._prepare_inputs(rows, q_lens)
        sampling = batch.advance(rows, step.seq_lens)  # (the rows' state, while it is in cache)
        with self._timed():
            if self.graphs is not None and self.graphs.can_run(step):
                hidden = self.graphs.run(input_ids, positions, step)
            else:
                hidden = self._forward_stage(input_ids, positions,
                                             self.backend.build_metadata(step))
        if out.grammar_deferred and (hidden is None or not len(sampling)):
            return DEFERRED  # its sample_tokens comes all the same
        if hidden is None:  # a stage before the last
            return NOT_OUTPUT_RANK
        if not len(sampling):  # no row completes its prompt
            return self._no_samples()
        if len(sampling) < hidden.shape[0]:  # the last token of each row that samples
            last_token = step.query_start_loc[1:][sampling] - 1
            hidden = hidden.index_select(0, to_device(last_token, self.device))
        if len(sampling) < len(rows):
            rows, req_ids = rows[sampling], [req_ids[i] for i in sampling.tolist()]
        with self._timed():
            logits = self.model.compute_logits(hidden)
        if logits is None:  # not the output rank
            if self.share_sampled is not None:
                self._receive_sampled(rows)
            return DEFERRED if out.grammar_deferred else NOT_OUTPUT_RANK
        if out.grammar_deferred:
            self._unsampled = _Unsampled(logits, rows, req_ids)
            return DEFERRED
        return self._sample(logits, rows, req_ids, out.grammar)

    def _sample(self, logits: torch.Tensor, rows: np.ndarray, req_ids: list[str],
                grammar: GrammarBitmask | None) -> Sampled:
        if grammar is not None:  # structured outputs: their rows' allowed tokens
            where = {r: i for i, r in enumerate(req_ids)}
            with profiler_label("parashift::grammar"):
                apply_token_bitmask(logits, [where.get(r) for r in grammar.req_ids],
                                    grammar.bits, grammar.words)
        with profiler_label("parashift::sample"):
            self._resolve_pending()  # the penalty counts need the last step's tokens
            md = self._sampling_metadata(rows)
            with self._timed():
                tokens, logprobs = self.sampler.sample(logits, md)
        if self.share_sampled is not None:  # (created on the device: NCCL takes no CPU tensor)
            self.share_sampled.broadcast(tokens)
        if self.placeholders:
            sampled = SampledTokens(tokens)
            self._set_pending(rows, sampled)
            return Sampled(AsyncModelRunnerOutput(req_ids, sampled, logprobs))
        # One step at a time the scheduler sends these tokens with the next step: the rows
        # take them from there (InputBatch.write_tokens).
        return Sampled(runner_output(req_ids, tokens.tolist(), logprobs))

    def _set_pending(self, rows: np.ndarray, sampled: SampledTokens) -> None:
        """The placeholders of a step scheduled before these tokens reach the scheduler."""
        self.batch.append_pending(rows)
        self._sampled = sampled

    def _resolve_pending(self) -> None:
        if self._sampled is not None:
            self.batch.resolve_pending(self._sampled.tolist())
            self._sampled = None

    def _sampling_metadata(self, rows: np.ndarray) -> SamplingMetadata:
        """The columns of the same rows as last step (no request came or went) are reused."""
        key = (self.batch.version, rows.tobytes())
        cache = self._sampling_cache
        md = sampling_metadata(self.batch, rows, self.vocab_size, self.device,
                               cache[1] if cache is not None and cache[0] == key else None)
        self._sampling_cache = (key, md)
        return md

    def _receive_sampled(self, rows: np.ndarray) -> None:
        """A tp rank that does not sample: rank 0's ids, for the placeholders after."""
        tokens = self.share_sampled.broadcast(torch.empty(len(rows), dtype=torch.long,
                                                          device=self.device))
        self._resolve_pending()
        self._set_pending(rows, SampledTokens(tokens))

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

    def _prepare_inputs(self, rows: np.ndarray, q_lens: np.ndarray):
        """The step's flat inputs, gathered from the batch's rows with array ops."""
        batch, bs, n = self.batch, self.block_size, len(rows)
        starts = batch.num_computed_tokens[rows]
        seq_lens = starts + q_lens
        block_table = batch.block_table[rows, : -(-int(seq_lens.max()) // bs)]
        if q_lens[-1] == 1:  # decodes come first: all of them are
            cu = np.arange(n + 1)
            positions, token_rows, table_rows, num_decodes = starts, rows, cu[:n], n
        else:
            cu = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(q_lens, out=cu[1:])
            positions = np.repeat(starts - cu[:-1], q_lens) + np.arange(cu[-1])
            token_rows = np.repeat(rows, q_lens)
            table_rows = np.repeat(np.arange(n), q_lens)
            num_decodes = int(np.searchsorted(q_lens > 1, True))
        input_ids = batch.token_ids[token_rows, positions]
        slot_mapping = block_table[table_rows, positions // bs] * bs + positions % bs
        step = AttentionStepInputs(
            query_start_loc=cu,
            seq_lens=seq_lens,
            num_computed_tokens=starts,
            block_table=block_table,
            slot_mapping=to_device(slot_mapping, self.device),
            num_decodes=num_decodes,
            block_size=bs,
            sliding_window=getattr(self.model, "sliding_window", None),
            device=self.device,
        )
        input_ids = to_device(input_ids, self.device)
        if self._sampled is not None:  # async: placeholders, from the last sampled ids
            at, index = batch.pending_tokens(token_rows, positions)
            if len(at):
                input_ids[to_device(at, self.device)] = self._sampled.ids[
                    to_device(index, self.device)]
        return input_ids, to_device(positions, self.device), step
