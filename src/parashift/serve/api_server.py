"""The OpenAI-compatible HTTP server (aiohttp): its routes and how a request becomes engine
requests. Its process (one per --api-server-count, all on one listening socket):
serve/api_process.py."""

from __future__ import annotations

import contextlib
import logging
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from parashift.engine.request import check_prompt_tokens
from parashift.engine.structured_output import Grammars
from parashift.serve import responses, sse
from parashift.serve.engine_client import EngineClient
from parashift.serve.engine_ranks import RankStatus
from parashift.serve.engine_routes import ADMIN_ROUTES, EngineRoutes
from parashift.serve.generation import Generation
from parashift.serve.handoff import EnginePools
from parashift.serve.http_guards import (
    REQUEST_ID,
    allowed_hosts,
    check_host,
    errors_to_openai,
    refuse_cross_site,
    require_key,
)
from parashift.serve.intake import BoundedPool, chat_chars, read_body
from parashift.serve.limits import ServeLimits
from parashift.serve.metrics import Metrics
from parashift.serve.openai_protocol import (
    MAX_CHOICES,
    MAX_PROMPTS,
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
)
from parashift.serve.openapi import openapi_document
from parashift.serve.output_budget import check_output_budget
from parashift.serve.prefix_router import RoutingConfig
from parashift.serve.request_params import (
    chat_messages,
    check_compiles,
    constrained,
    sampling_params,
)
from parashift.serve.respond import Responder, paced_answers
from parashift.serve.tool_calls import ToolPlan, template_messages, tool_plan
from parashift.types.structured_outputs import StructuredOutputsParams
from parashift.wire.cluster_auth import HeadKeys

logger = logging.getLogger(__name__)


@dataclass
class ApiServerArgs:
    index: int
    request_address: str
    output_address: str
    num_engines: int  # the ranks there may be (up to --data-parallel-size-max)
    tokenizer_path: str
    served_model_name: str
    max_model_len: int
    eos_token_id: int | None
    vocab_size: int
    api_key: str | None = field(default=None, repr=False)
    log_level: str = "INFO"
    coordinator_address: str | None = None  # the DP coordinator's PUB (dp > 1)
    request_timeout: float | None = None  # seconds a generation may take; None: no limit
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    bound: dict[str, socket.socket] = field(default_factory=dict)  # tcp: bound by the launcher
    max_body_bytes: int = 8 << 20
    tool_call_parser: str | None = None  # --enable-auto-tool-choice: tool_choice "auto" reads
    head_keys: HeadKeys | None = field(default=None, repr=False)  # over CURVE (engine_client)
    launcher_identity: bytes = b"launcher"  # the launcher's on our request socket
    limits: ServeLimits = field(default_factory=ServeLimits)
    size: int | None = None  # the ranks launched first (elastic: fewer than num_engines)
    prefill_engines: int = 0  # prefill/decode pools: the first this many ranks prefill



def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(data), status=status,
                        content_type="application/json")


class ApiServer:
    def __init__(self, args: ApiServerArgs):
        from transformers import AutoTokenizer

        self.args = args
        self.tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path)  # nosec B615
        # Tokenizing and chat templates run here, off the event loop (one thread: the
        # tokenizer is not shared between threads), with a bounded queue (429 beyond).
        self.tokenize_pool = BoundedPool(args.limits.max_tokenize_queue, "parashift-tokenize")
        # A text longer than this many characters cannot fit max_model_len at any
        # tokenization: no token is longer than the longest in the vocabulary.
        longest = max((len(t) for t in self.tokenizer.get_vocab()), default=1)
        self.max_prompt_chars = args.max_model_len * max(1, longest)
        self.engines = EngineClient(args.index, args.request_address, args.output_address,
                                    args.num_engines, args.coordinator_address, args.bound,
                                    args.routing, args.head_keys, args.launcher_identity,
                                    args.size, EnginePools(args.prefill_engines)
                                    if args.prefill_engines else None)
        # Structured outputs: each constraint is compiled here once first, so that a bad one
        # is a 400 (in a compile process of this server's, started on first use; only the
        # outcome comes back: the engine compiles its own).
        self.grammars = Grammars(args.tokenizer_path, args.vocab_size,
                                 name=f"parashift-grammar-api{args.index}", keep_grammars=False,
                                 timeout_s=args.limits.grammar_compile_timeout)
        self.metrics = Metrics()
        self.engines.on_outputs = self.metrics.on_engine_outputs
        self.engines.on_load = self.metrics.on_load_vector
        self.metrics.api_server.labels(str(args.index)).set(1)
        self.responder = Responder(args.request_timeout, args.limits,
                                   self.tokenize_pool.executor, self.metrics)

    def app(self) -> web.Application:
        limits = self.args.limits
        app = web.Application(
            middlewares=[paced_answers(limits.stream_idle_timeout), self._count,
                         errors_to_openai, check_host(allowed_hosts(limits)), refuse_cross_site,
                         require_key(self.args.api_key, limits.admin_api_key, ADMIN_ROUTES)],
            client_max_size=self.args.max_body_bytes)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_endpoint)
        app.router.add_get("/openapi.json", self.openapi)
        if limits.admin_routes:  # off by default: absent (404) without a key or the flag
            EngineRoutes(self.engines, self.metrics).add_to(app)
        return app

    @web.middleware
    async def _count(self, request: web.Request, handler):
        if request.path not in ("/v1/completions", "/v1/chat/completions"):
            return await handler(request)
        code = 499  # the client went away: the handler was cancelled
        try:
            response = await handler(request)
            code = 499 if request.get(sse.CLIENT_LEFT) else response.status
            return response
        finally:
            self.metrics.responses.labels(str(code)).inc()

    # --- endpoints ---------------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        return _json({"object": "list", "data": [{
            "id": self.args.served_model_name, "object": "model", "created": int(time.time()),
            "owned_by": "parashift", "max_model_len": self.args.max_model_len}]})

    async def health(self, request: web.Request) -> web.Response:
        ok, reason = self.engines.health()
        return _json({"status": "ok" if ok else "unavailable", "detail": reason,
                      "ranks": self.engines.ranks.states()}, 200 if ok else 503)

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        serving = self.engines.alive_engines()
        for rank in range(self.args.num_engines):
            if self.engines.ranks.status(rank) != RankStatus.ABSENT:
                self.metrics.engine_up.labels(f"dp{rank}").set(1 if rank in serving else 0)
            else:  # not part of the deployment (elastic): no series
                with contextlib.suppress(KeyError):
                    self.metrics.engine_up.remove(f"dp{rank}")
        self.metrics.dp_size.set(self.engines.ranks.size)
        return web.Response(body=self.metrics.render(),
                            content_type="text/plain", charset="utf-8")

    async def openapi(self, request: web.Request) -> web.Response:
        from importlib.metadata import version

        return _json(openapi_document(version("parashift"), self.args.limits.admin_routes))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = await read_body(request, CompletionRequest, self.args.limits.stream_idle_timeout)
        self._check_model(req.model)
        if req.suffix is not None:
            raise OpenAIError(400, "suffix is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise OpenAIError(400, "best_of other than n is not supported", param="best_of")
        if req.echo and req.logprobs is not None:
            raise OpenAIError(400, "echo together with logprobs is not supported", param="echo")
        prompts = await self._completion_prompts(req.prompt, req.n)
        return await self._generate(request, req, prompts, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        req = await read_body(request, ChatCompletionRequest,
                              self.args.limits.stream_idle_timeout)
        self._check_model(req.model)
        tools = tool_plan(req, self.args.tool_call_parser)
        # Every text counted before any is decoded or rendered (tool-call arguments too).
        chars = chat_chars(req) + len(msgspec.json.encode(tools.tools))
        if chars > self.max_prompt_chars:
            raise OpenAIError(400, f"the messages hold {chars} characters: more than any "
                              f"{self.args.max_model_len}-token context can hold",
                              param="messages")
        messages = template_messages(chat_messages(req))

        def render() -> list[int]:
            ids = self.tokenizer.apply_chat_template(messages, tools=tools.tools or None,
                                                     add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

        try:
            ids = await self._off_loop(render)
        except Exception as e:
            raise OpenAIError(400, f"the chat template failed: {e}", param="messages") from e
        return await self._generate(request, req, [ids], chat=True, tools=tools)

    async def _off_loop(self, fn, *args):
        return await self.tokenize_pool.run(fn, *args)

    # --- helpers -----------------------------------------------------------------------------
    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.args.served_model_name:
            raise OpenAIError(404, f"the model {model!r} does not exist; this server serves "
                              f"{self.args.served_model_name!r}", "invalid_request_error",
                              param="model", code="model_not_found")

    async def _completion_prompts(self, prompt: Any, n: int) -> list[list[int]]:
        """Token ids of each prompt; how many prompts and how long each text is are checked
        before anything is tokenized (off the event loop)."""
        kinds = {type(x) for x in prompt} if isinstance(prompt, list) else {str}
        if len(kinds) > 1:
            raise OpenAIError(400, "prompt must be a string, a list of strings, a list of token "
                              "ids or a list of token-id lists, not a mix", param="prompt")
        texts = [prompt] if isinstance(prompt, str) else prompt if kinds == {str} else None
        count = 1 if kinds == {int} else len(texts if texts is not None else prompt)
        if count > MAX_PROMPTS or count * n > MAX_CHOICES:
            raise OpenAIError(400, f"{count} prompts x n={n} is more than {MAX_CHOICES} choices "
                              f"in one request", param="n")
        if texts is not None:
            longest = max((len(t) for t in texts), default=0)
            if longest > self.max_prompt_chars:
                raise OpenAIError(400, f"a prompt of {longest} characters is longer than any "
                                  f"{self.args.max_model_len}-token context can hold",
                                  param="prompt")
            prompts = await self._off_loop(lambda: [self.tokenizer.encode(t) for t in texts])
        elif kinds == {int}:
            prompts = [list(prompt)]
        else:
            prompts = [list(p) for p in prompt]
        if not prompts:
            raise OpenAIError(400, "the prompt must not be empty", param="prompt")
        return prompts

    def _check_tokens(self, prompts: list[list[int]], param: str) -> None:
        """The engine's own check, answered here as a 400: token ids the model has no
        embedding for (given, or from a tokenizer larger than the model's vocabulary)."""
        for p in prompts:
            try:
                check_prompt_tokens(p, self.args.vocab_size)
            except ValueError as e:
                raise OpenAIError(400, str(e), param=param) from None

    async def _check_constraint(self, constraint: StructuredOutputsParams, param: str) -> None:
        """A 400 naming `param` for a constraint that does not compile, a 429 while too many
        compiles wait, bounded in time (serve/request_params.py `check_compiles`)."""
        await check_compiles(self.grammars, constraint, param)

    def _rank(self, request: web.Request) -> int | None:
        pinned = request.headers.get("X-data-parallel-rank")
        if pinned is None:
            return None
        if not pinned.isdigit() or int(pinned) >= self.args.num_engines:
            raise OpenAIError(400, f"X-data-parallel-rank must be 0..{self.args.num_engines - 1}")
        return int(pinned)

    async def _generate(self, request: web.Request, req: Any, prompts: list[list[int]],
                        chat: bool, tools: ToolPlan | None = None) -> web.StreamResponse:
        self._check_tokens(prompts, "messages" if chat else "prompt")
        if len(prompts) * req.n > MAX_CHOICES:
            raise OpenAIError(400, f"{len(prompts)} prompts x n={req.n} is more than "
                              f"{MAX_CHOICES} choices in one request", param="n")
        params, field = constrained(
            req, [sampling_params(req, len(p), self.args.max_model_len) for p in prompts],
            tools.constraint if tools is not None else None)
        check_output_budget(req, prompts, params, self.args.limits.max_request_output_units,
                            self.args.max_model_len)
        if field is not None:
            await self._check_constraint(params[0].structured_outputs, field)
        prefix = "chatcmpl" if chat else "cmpl"
        request_id = request[REQUEST_ID] = f"{prefix}-{self.args.index}-{uuid.uuid4().hex}"
        hashes = (await self._off_loop(self.engines.route_hashes, prompts, params[0].cache_salt)
                  if self.engines.routes_by_prefix else [])
        gen = Generation(self.engines, self.tokenizer, request_id, prompts, params,
                         self.args.eos_token_id, self._rank(request), req.stream,
                         lambda outcome: self.metrics.failovers.labels(outcome).inc(), hashes)
        self.metrics.routed.labels(f"dp{gen.engine}").inc()
        formatter = (responses.ChatFormatter(request_id, self.args.served_model_name,
                                             self.tokenizer, gen, req, tools=tools) if chat
                     else responses.CompletionFormatter(request_id, self.args.served_model_name,
                                                        self.tokenizer, gen, req))
        return await self.responder.respond(request, gen, formatter)
