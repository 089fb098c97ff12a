"""The soak's requests (scripts/soak_run.py): a seeded mix of good, special, bad and disconnecting
requests, each sent once and checked against what it must get back."""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"

WORDS = ("alpha", "beta", "gamma", "delta", "river", "stone", "light", "north", "seven")
BAD = [  # (body, the status it must get)
    (b'{"prompt": "hi", "max_tokens": ', 400),
    (json.dumps({"prompt": "hi", "n": 100000}).encode(), 400),
    (json.dumps({"prompt": "hi", "seed": 2**80}).encode(), 400),
    (json.dumps({"prompt": "hi", "max_token": 4}).encode(), 400),  # nosec B105
    (json.dumps({"prompt": "hi", "max_tokens": -3}).encode(), 400),
    (json.dumps({"prompt": [1] * 600, "max_tokens": 4}).encode(), 400),  # past max-model-len
    (json.dumps({"prompt": "hi", "model": "no-such-model"}).encode(), 404),
    (json.dumps({"prompt": [1, 2**40]}).encode(), 400),
]
@dataclass
class SoakRequest:
    kind: str  # good, special, bad, disconnect
    path: str
    body: bytes
    stream: bool = False
    tokens: int | None = None  # completion tokens a good request must report
    status: int = 200  # what a bad one must get
    logprobs: bool = False


@dataclass
class Outcome:
    kind: str
    status: int  # the HTTP status; 499: we left
    ok: bool
    why: str = ""
    response_id: str | None = None
    start: float = 0.0
    end: float = 0.0
    cut_by_kill: bool = False  # a stream the engine's death ended after it had sent tokens


def plan(num_requests: int, vocab: int, seed: int = 0) -> list[SoakRequest]:
    rng = random.Random(seed)  # nosec B311
    out = []
    for _ in range(num_requests):
        draw = rng.random()
        ids = [rng.randrange(1, vocab) for _ in range(rng.randint(4, 96))]
        tokens = rng.randint(1, 32)
        if draw < 0.10:
            body, status = rng.choice(BAD)
            out.append(SoakRequest("bad", COMPLETIONS, body, status=status))
        elif draw < 0.20:
            out.append(SoakRequest("disconnect", COMPLETIONS, _body(
                {"prompt": ids, "max_tokens": 200, "ignore_eos": True, "stream": True}), True))
        elif draw < 0.22:
            out.append(_special(rng, ids, tokens))
        else:
            stream = rng.random() < 0.5
            sampling = ({"temperature": 0} if rng.random() < 0.5
                        else {"temperature": 0.8, "seed": rng.randrange(1000)})
            extra = {"stream": stream, "ignore_eos": True, "max_tokens": tokens, **sampling,
                     **({"stream_options": {"include_usage": True}} if stream else {})}
            if rng.random() < 0.3:
                text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 40)))
                body = {"messages": [{"role": "user", "content": text}], **extra}
                out.append(SoakRequest("good", CHAT, _body(body), stream, tokens))
            else:
                out.append(SoakRequest("good", COMPLETIONS, _body({"prompt": ids, **extra}),
                                       stream, tokens))
    return out


def _special(rng: random.Random, ids: list[int], tokens: int) -> SoakRequest:
    base = {"prompt": ids, "max_tokens": tokens, "ignore_eos": True}
    which = rng.choice(["n", "logprobs", "stop"])
    if which == "n":
        return SoakRequest("special", COMPLETIONS, _body({**base, "n": 2, "seed": 1}),
                           tokens=2 * tokens)
    if which == "logprobs":
        return SoakRequest("special", COMPLETIONS, _body({**base, "logprobs": 2}),
                           tokens=tokens, logprobs=True)
    return SoakRequest("special", COMPLETIONS, _body({**base, "stop": ["e", "a"],
                                                      "ignore_eos": False}))


def _body(data: dict[str, Any]) -> bytes:
    return json.dumps(data).encode()


async def send(session: aiohttp.ClientSession, url: str, req: SoakRequest, start: float
                ) -> Outcome:
    o = Outcome(req.kind, 0, False, start=time.monotonic() - start)
    try:
        async with session.post(url + req.path, data=req.body, headers={
                "Content-Type": "application/json"}) as r:
            o.status = r.status
            if req.kind == "bad":
                body = await r.json(content_type=None)
                o.ok = r.status == req.status and set(body) == {"error"}
                o.why = "" if o.ok else f"wanted {req.status}: {body}"
            elif req.kind == "disconnect":
                async for _ in r.content:  # the first line of the stream, then we leave
                    break
                o.status, o.ok = 499, True
                r.close()
            elif req.stream and r.status == 200:
                _check_stream(o, req, [line async for line in r.content])
            else:
                _check_json(o, req, await r.json(content_type=None))
    except (TimeoutError, aiohttp.ClientError, ValueError) as e:
        o.why = f"{type(e).__name__}: {e}"
    o.end = time.monotonic() - start
    return o


def _check_json(o: Outcome, req: SoakRequest, body: dict) -> None:
    if o.status != 200:
        o.why = str(body)
        return
    o.response_id = body.get("id")
    got = body["usage"]["completion_tokens"]
    if req.tokens is not None and got != req.tokens:
        o.why = f"{got} completion tokens, wanted {req.tokens}"
        return
    if req.logprobs and any(len(c["logprobs"]["tokens"]) != req.tokens
                            for c in body["choices"]):
        o.why = "logprobs do not cover every token"
        return
    o.ok = all(c["finish_reason"] in ("length", "stop") for c in body["choices"])
    o.why = "" if o.ok else f"finish reasons {[c['finish_reason'] for c in body['choices']]}"


def _check_stream(o: Outcome, req: SoakRequest, lines: list[bytes]) -> None:
    events = [line[6:].strip() for line in lines if line.startswith(b"data: ")]
    if not events or events[-1] != b"[DONE]":
        o.why = "the stream did not end with [DONE]"
        return
    chunks = [json.loads(e) for e in events[:-1]]
    errors = [c["error"] for c in chunks if "error" in c]
    if errors:
        had_tokens = any(c.get("choices") and (c["choices"][0].get("text") or
                                               c["choices"][0].get("delta", {}).get("content"))
                         for c in chunks)
        o.cut_by_kill = had_tokens and "died" in errors[0]["message"]
        o.why = errors[0]["message"]
        return
    usage = [c["usage"] for c in chunks if c.get("usage")]
    o.response_id = chunks[0].get("id") if chunks else None
    o.ok = bool(usage) and usage[-1]["completion_tokens"] == req.tokens
    o.why = "" if o.ok else f"usage {usage[-1:] or 'missing'}, wanted {req.tokens} tokens"
