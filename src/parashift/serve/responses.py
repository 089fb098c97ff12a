"""OpenAI response bodies for completions and chat completions, whole or as SSE chunks. A
whole body is built where the tokenizer runs, off the event loop (api_server.py); a chunk's
work is bounded by its delta: logprob texts are decoded in batches, tool calls read
incrementally."""

from __future__ import annotations

import time
from typing import Any

import msgspec

from parashift.engine.detokenizer import TokenTexts
from parashift.engine.request_tracker import Sample as Choice
from parashift.engine.request_tracker import SampleDelta as Delta
from parashift.serve.generation import Generation
from parashift.serve.tool_call_formats import reader_for
from parashift.serve.tool_call_reader import ToolCallReader
from parashift.serve.tool_calls import ToolPlan, new_call_id
from parashift.types.outputs import TokenLogprobs


def sse(data: Any) -> bytes:
    return b"data: " + msgspec.json.encode(data) + b"\n\n"


class Formatter:
    object_name = ""
    chunk_object_name = ""

    def __init__(self, request_id: str, model: str, tokenizer: Any, gen: Generation, req: Any):
        self.id = request_id
        self.model = model
        self.tokenizer = tokenizer
        self.gen = gen
        self.req = req
        self.created = int(time.time())
        self._texts = TokenTexts(tokenizer)
        # a streamed choice's index -> (its sample, how many of its logprobs went out)
        self._logprobs_sent: dict[int, tuple[Choice, int]] = {}

    def _new_logprobs(self, delta: Delta) -> list[TokenLogprobs]:
        """The delta's logprobs: the next ones its choice's stream has not sent. Counted from
        the start, not the end: outputs are applied as they arrive, so the sample may hold
        more by the time this delta is written."""
        sample = delta.sample
        last, sent = self._logprobs_sent.get(sample.index, (None, 0))
        if last is not sample:  # a failover started the choice over
            sent = 0
        self._logprobs_sent[sample.index] = (sample, sent + delta.num_new_logprobs)
        return sample.logprobs[sent : sent + delta.num_new_logprobs]

    def _entry_texts(self, entries: list[TokenLogprobs]) -> list[list[str]]:
        """Per entry, the sampled token's text then its alternatives': one batch decode."""
        texts = self._texts([t for lp in entries for t in lp.token_ids])
        out, at = [], 0
        for lp in entries:
            out.append(texts[at : at + len(lp.token_ids)])
            at += len(lp.token_ids)
        return out

    def usage(self) -> dict[str, Any]:
        prompt, completion = self.gen.num_prompt_tokens, self.gen.num_output_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                # OpenAI's field for the prompt tokens the prefix cache served
                "prompt_tokens_details": {"cached_tokens": self.gen.num_cached_tokens}}

    def _envelope(self, choices: list[dict], chunk: bool) -> dict[str, Any]:
        return {"id": self.id, "object": self.chunk_object_name if chunk else self.object_name,
                "created": self.created, "model": self.model, "choices": choices}

    def full_response(self) -> dict[str, Any]:
        body = self._envelope([self._full_choice(c) for c in self._ordered()], chunk=False)
        body["usage"] = self.usage()
        return body

    def _ordered(self) -> list[Choice]:
        return sorted(self.gen.choices.values(), key=lambda c: c.index)

    def stream_start(self) -> list[dict]:
        return []

    def stream_usage(self) -> dict | None:
        options = self.req.stream_options
        if options is None or not options.include_usage:
            return None
        body = self._envelope([], chunk=True)
        body["usage"] = self.usage()
        return body

    def _full_choice(self, choice: Choice) -> dict:
        raise NotImplementedError

    def stream_chunk(self, delta: Delta) -> dict:
        raise NotImplementedError

    def stream_chunks(self, delta: Delta) -> list[dict]:
        return [self.stream_chunk(delta)]


class CompletionFormatter(Formatter):
    object_name = chunk_object_name = "text_completion"

    def __init__(self, *args: Any):
        super().__init__(*args)
        self._echoed: set[int] = set()
        self._offsets: dict[int, int] = {}  # choice -> text offset of its next streamed token

    def _logprobs(self, entries: list[TokenLogprobs], text_start: int) -> dict | None:
        if self.req.logprobs is None:
            return None
        tokens, token_logprobs, top, offsets = [], [], [], []
        offset = text_start
        for lp, texts in zip(entries, self._entry_texts(entries), strict=True):
            tokens.append(texts[0])
            token_logprobs.append(lp.logprobs[0])
            top.append(dict(zip(texts[1:], lp.logprobs[1:], strict=True)))
            offsets.append(offset)
            offset += len(texts[0])
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
                "text_offset": offsets}

    def _prompt_text(self, choice: Choice) -> str:
        if not self.req.echo:
            return ""
        prompt = self.req.prompt
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[choice.prompt_index], str):
            return prompt[choice.prompt_index]
        return self.tokenizer.decode(self.gen.prompts[choice.prompt_index])

    def _full_choice(self, choice: Choice) -> dict:
        echo = self._prompt_text(choice)
        return {"index": choice.index, "text": echo + choice.text,
                "logprobs": self._logprobs(choice.logprobs, len(echo)),
                "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason}

    def stream_chunk(self, delta: Delta) -> dict:
        choice = delta.sample
        text = delta.text
        if self.req.echo and choice.index not in self._echoed:
            text = self._prompt_text(choice) + text
            self._echoed.add(choice.index)
        logprobs = self._logprobs(self._new_logprobs(delta), self._offsets.get(
            choice.index, len(text) - len(delta.text)))
        if logprobs is not None and logprobs["tokens"]:
            self._offsets[choice.index] = logprobs["text_offset"][-1] + len(
                logprobs["tokens"][-1])
        return self._envelope([{
            "index": choice.index, "text": text, "logprobs": logprobs,
            "finish_reason": choice.finish_reason if delta.finished else None,
            "stop_reason": choice.stop_reason if delta.finished else None,
        }], chunk=True)


class ChatFormatter(Formatter):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(self, *args: Any, tools: ToolPlan | None = None):
        super().__init__(*args)
        self.tools = tools if tools is not None and tools.mode != "none" else None
        # a streamed choice's index -> its reader and its calls' ids
        self._readers: dict[int, tuple[ToolCallReader, list[str]]] = {}

    @staticmethod
    def _entry(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    def _logprobs(self, entries: list[TokenLogprobs]) -> dict | None:
        if not self.req.logprobs:
            return None
        content = []
        for lp, texts in zip(entries, self._entry_texts(entries), strict=True):
            item = self._entry(texts[0], lp.logprobs[0])
            item["top_logprobs"] = [self._entry(t, v) for t, v in
                                    zip(texts[1:], lp.logprobs[1:], strict=True)]
            content.append(item)
        return {"content": content}

    def _full_choice(self, choice: Choice) -> dict:
        message: dict[str, Any] = {"role": "assistant", "content": choice.text}
        finish = choice.finish_reason
        if self.tools is not None:
            content, calls = reader_for(self.tools).read(choice.text)
            calls = [c for c in calls if c.complete]  # one cut off by max_tokens is no call
            if calls:
                message = {"role": "assistant", "content": content.strip() or None,
                           "tool_calls": [{"id": new_call_id(), "type": "function",
                                           "function": {"name": c.name,
                                                        "arguments": c.arguments}}
                                          for c in calls]}
                finish = "tool_calls" if finish == "stop" else finish
        return {"index": choice.index, "message": message,
                "logprobs": self._logprobs(choice.logprobs),
                "finish_reason": finish, "stop_reason": choice.stop_reason}

    def stream_start(self) -> list[dict]:
        return [self._envelope([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None}], chunk=True)
                for c in self._ordered()]

    def stream_chunk(self, delta: Delta) -> dict:
        choice = delta.sample
        return self._envelope([{
            "index": choice.index,
            "delta": {"content": delta.text} if delta.text else {},
            "logprobs": self._logprobs(self._new_logprobs(delta)),
            "finish_reason": choice.finish_reason if delta.finished else None,
        }], chunk=True)

    def stream_chunks(self, delta: Delta) -> list[dict]:
        """With tools: the choice's new text read by its reader; what it makes known goes out
        as content, as a call's id and name, or as a piece of a call's arguments."""
        if self.tools is None:
            return [self.stream_chunk(delta)]
        choice = delta.sample
        if choice.index not in self._readers:
            self._readers[choice.index] = (reader_for(self.tools), [])
        reader, ids = self._readers[choice.index]
        deltas: list[dict[str, Any]] = []
        for event in reader.feed(delta.text, final=delta.finished):
            if event.kind == "content":
                if deltas and "content" in deltas[-1]:
                    deltas[-1]["content"] += event.text
                else:
                    deltas.append({"content": event.text})
            elif event.kind == "call":
                ids.append(new_call_id())
                deltas.append({"tool_calls": [{"index": event.index, "id": ids[-1],
                                               "type": "function", "function": {
                                                   "name": event.text, "arguments": ""}}]})
            else:
                deltas.append({"tool_calls": [{"index": event.index, "function": {
                    "arguments": event.text}}]})
        if not deltas and (delta.finished or delta.num_new_logprobs):
            deltas.append({})
        logprobs = self._logprobs(self._new_logprobs(delta))
        finish = choice.finish_reason if delta.finished else None
        if finish == "stop" and ids:
            finish = "tool_calls"
        return [self._envelope([{
            "index": choice.index, "delta": d,
            "logprobs": logprobs if i == 0 else None,
            "finish_reason": finish if i == len(deltas) - 1 else None,
        }], chunk=True) for i, d in enumerate(deltas)]
