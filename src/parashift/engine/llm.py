"""The offline API: `LLM(model).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from tqdm.auto import tqdm
from transformers import AutoTokenizer

from parashift.config import EngineConfig
from parashift.engine.args import EngineArgs, create_config
from parashift.engine.core import EngineCore
from parashift.engine.output_processor import OutputProcessor, new_request_output
from parashift.engine.request import Request, check_prompt_tokens
from parashift.engine.request_output import RequestOutput
from parashift.engine.request_tracker import choose_eos_token_id
from parashift.types.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Prompt = str | list[int]
Message = dict[str, str]


class LLM:
    """An engine in this process. Keyword arguments are `EngineArgs` fields
    (dtype, max_model_len, max_num_seqs, kv_cache_memory, enable_prefix_caching, ...)."""

    def __init__(self, model: str | None = None, **engine_args: Any):
        self._init_from(create_config(EngineArgs(model=model, **engine_args)))

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLM:
        return cls.from_config(create_config(engine_args))

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        """From a config resolved already (create_config), which it does not resolve again."""
        llm = cls.__new__(cls)
        llm._init_from(config)
        return llm

    def _init_from(self, config: EngineConfig) -> None:
        self.config = config
        if self.config.parallel.strategy.processes().num_engines > 1:
            raise ValueError("offline generation runs one engine: data parallel (dp > 1) is "
                             "served by `parashift run --strategy dpN`")
        tokenizer_path = self.config.model.tokenizer_path
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)  # nosec B615
        self.engine = EngineCore(self.config)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._next_id = 0

    def shutdown(self) -> None:
        """Stops the engine's tensor-parallel workers now (they also stop when the LLM is
        garbage-collected, or with this process)."""
        self.engine.shutdown()

    @property
    def eos_token_id(self) -> int | None:
        return choose_eos_token_id(self.config.model.hf_config, self.tokenizer)

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        on_output: Callable[[str, str], None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in prompt order.
        `on_output(request_id, new_text)` sees text as it is produced (for streaming)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(sampling_params)} "
                             "sampling params")
        # Validate the whole batch before queueing any of it.
        for sp in sampling_params:
            sp.validate()
            if sp.structured_outputs is not None:  # a bad constraint: ValueError, naming it
                self.engine.structured_grammars().compile_now(sp.structured_outputs)
        checked = [(*self._tokenize(p), sp) for p, sp in zip(prompts, sampling_params,
                                                           strict=True)]
        request_ids = [self._add_request(text, ids, sp) for text, ids, sp in checked]
        results = self._run(len(request_ids), use_tqdm, on_output)
        return [results[r] for r in request_ids]

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        on_output: Callable[[str, str], None] | None = None,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to each conversation, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, on_output)

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True
                            ) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template")
        for m in messages:
            if m.get("role") not in ("system", "user", "assistant"):
                raise ValueError(f"message role must be system, user or assistant, got "
                                 f"{m.get('role')!r}")
        ids = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, list(prompt)
        self._validate_prompt(token_ids)
        return text, token_ids

    def _add_request(self, text: str | None, token_ids: list[int], params: SamplingParams) -> str:
        request_id = str(self._next_id)
        self._next_id += 1
        now = time.monotonic()
        output = new_request_output(request_id, text, token_ids, now)
        for sample_id, sample_params in self.output_processor.add_request(output, params):
            self.engine.add_request(Request(sample_id, token_ids, sample_params,
                                            self.eos_token_id, now))
        return request_id

    def _validate_prompt(self, token_ids: list[int]) -> None:
        max_len = self.config.model.max_model_len
        check_prompt_tokens(token_ids, self.config.model.vocab_size)
        if len(token_ids) >= max_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens but max_model_len is "
                             f"{max_len}: no room to generate (shorten it or raise "
                             "--max-model-len)")

    def _run(self, num_requests: int, use_tqdm: bool,
             on_output: Callable[[str, str], None] | None) -> dict[str, RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=num_requests, desc="generating", unit="req", disable=not use_tqdm)
        num_tokens, start = 0, time.perf_counter()
        try:
            while self.engine.has_unfinished_requests():
                outputs = self.engine.step()
                processed = self.output_processor.process(outputs)
                if processed.to_abort:
                    self.engine.abort_requests(processed.to_abort)
                if on_output:
                    for sample_id, text in processed.text_deltas:
                        on_output(sample_id, text)
                finished = processed.finished
                num_tokens += len(outputs)
                for output in finished:
                    results[output.request_id] = output
                if finished:
                    bar.update(len(finished))
                    bar.set_postfix(out_tok_s=f"{num_tokens / (time.perf_counter() - start):.1f}")
        except BaseException:
            self.engine.abort_requests(list(self.output_processor.parent_of))
            self.output_processor = OutputProcessor(self.tokenizer)
            raise
        finally:
            bar.close()
        return results
