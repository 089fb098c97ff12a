"""serve/intake.py: the tokenizer pool's bound (a 429 with Retry-After beyond it, the count kept
until a task really ends), and a chat's size counted over every text it carries."""

from __future__ import annotations

import asyncio
import json
import threading

import msgspec
import pytest

from parashift.serve.http_guards import _error
from parashift.serve.intake import (
    BoundedPool,
    QueueFullError,
    chat_chars,
)
from parashift.serve.openai_protocol import ChatCompletionRequest


def test_the_pool_refuses_past_its_bound_with_retry_after():
    async def main() -> None:
        pool = BoundedPool(2, "test-tokenize")
        started, release = threading.Event(), threading.Event()

        def blocked() -> str:
            started.set()
            release.wait(30)
            return "done"

        first = asyncio.ensure_future(pool.run(blocked))
        second = asyncio.ensure_future(pool.run(lambda: "queued"))
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 30)
        with pytest.raises(QueueFullError) as info:
            await pool.run(lambda: "refused")
        response = _error(info.value)
        assert response.status == 429 and int(response.headers["Retry-After"]) >= 1
        assert int(response.headers["retry-after-ms"]) >= 1
        assert json.loads(response.body)["error"]["code"] == "tokenizer_queue_full"
        # A cancelled wait leaves its task counted while it runs: the thread is still busy.
        first.cancel()
        with pytest.raises(QueueFullError):
            await pool.run(lambda: "refused")
        release.set()
        assert await second == "queued"
        assert await pool.run(lambda: "again") == "again" and pool.num_tasks == 0
        pool.executor.shutdown()

    asyncio.run(main())


def test_chat_chars_counts_every_text_field():
    body = {"messages": [
        {"role": "system", "content": "s" * 10},
        {"role": "user", "name": "n" * 7, "content": [{"type": "text", "text": "t" * 20}]},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "c" * 5, "type": "function",
            "function": {"name": "f" * 3, "arguments": "a" * 1000}}]},
        {"role": "tool", "tool_call_id": "c" * 5, "content": "r" * 30}]}
    req = msgspec.json.decode(json.dumps(body), type=ChatCompletionRequest)
    roles = len("system") + len("user") + len("assistant") + len("tool")
    assert chat_chars(req) == roles + 10 + 7 + len("text") + 20 + 5 + 3 + 1000 + 5 + 30
