"""32 concurrent streams against the package's server (conftest.py): each gets the text it
would get alone, and none is left running."""

from __future__ import annotations

import asyncio

from .conftest import MODEL, complete


def test_32_concurrent_streams(server, client):
    prompts = [f"client {i:02d} asks: {'xyz'[i % 3] * (1 + i % 5)}" for i in range(32)]
    max_tokens = 16
    expected = [complete(client, p, max_tokens).choices[0].text for p in prompts]

    async def one(aclient, prompt):
        stream = await aclient.completions.create(
            model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        text, finish, usage = "", [], None
        async for chunk in stream:
            for c in chunk.choices:
                text += c.text
                if c.finish_reason:
                    finish.append(c.finish_reason)
            usage = chunk.usage or usage
        return text, finish, usage

    async def main():
        async with server.async_client() as aclient:
            return await asyncio.wait_for(
                asyncio.gather(*(one(aclient, p) for p in prompts)), timeout=120)

    results = asyncio.run(main())
    for prompt, want, (text, finish, usage) in zip(prompts, expected, results, strict=True):
        assert text == want, prompt
        assert finish == ["length"] and usage.completion_tokens == max_tokens
    assert server.metric("parashift_num_requests_running", 'engine="dp0"') == 0
