"""What every HTTP request passes before its handler: errors turned into OpenAI's error body
(a 500 names its log entry, never the exception), cross-site requests refused, and the API
key checked on every route but the liveness probe and the metrics scrape."""

from __future__ import annotations

import hashlib
import hmac
import logging
import uuid

import msgspec
from aiohttp import web

from parashift.serve.engine_errors import EngineDeadError, EngineUnavailableError
from parashift.serve.openai_protocol import OpenAIError

logger = logging.getLogger(__name__)

# Without the key: the liveness probe and the Prometheus scrape (counts, never request content).
OPEN_ROUTES = frozenset(("/health", "/metrics"))
JSON_ROUTES = frozenset(("/v1/completions", "/v1/chat/completions"))
# Content types a browser may POST cross-site without asking the server first (CORS "simple").
_SIMPLE_CONTENT_TYPES = frozenset(("text/plain", "application/x-www-form-urlencoded",
                                   "multipart/form-data"))


def _error(error: OpenAIError) -> web.Response:
    return web.Response(body=msgspec.json.encode(error.body()), status=error.status,
                        content_type="application/json")


@web.middleware
async def errors_to_openai(request: web.Request, handler):
    try:
        return await handler(request)
    except OpenAIError as e:
        return _error(e)
    except EngineUnavailableError as e:
        return _error(OpenAIError(503, str(e), "service_unavailable"))
    except EngineDeadError as e:
        return _error(OpenAIError(500, str(e), "engine_error"))
    except web.HTTPException as e:
        if e.status >= 400:
            return _error(OpenAIError(e.status, e.reason, "invalid_request_error"))
        raise
    except Exception:  # a bug must fail its request only, never the server
        return _error(internal_error(request))


def request_key(name: str, kind: type):
    """A key of a request's storage: typed where aiohttp has them (3.14), else its name."""
    return web.RequestKey(name, kind) if hasattr(web, "RequestKey") else name


REQUEST_ID = request_key("parashift.request_id", str)  # the id of the generation it started


def internal_error(request: web.Request) -> OpenAIError:
    """A bug's 500, to make inside its `except` block: the log gets the traceback under the
    request's id; the body names that id, never the exception (it may hold request content)."""
    request_id = request.get(REQUEST_ID) or f"http-{uuid.uuid4().hex}"
    logger.exception("internal error in request %s on %s", request_id, request.path)
    return OpenAIError(500, f"internal error in request {request_id} (see the server's log)",
                       "internal_error")


@web.middleware
async def refuse_cross_site(request: web.Request, handler):
    """A web page the user visits must not reach this server. JSON routes take only
    application/json (a cross-site page can send text/plain without a preflight); a browser's
    cross-origin request (its Origin names another host) is refused on every route that acts."""
    if request.method == "POST":
        if request.path in JSON_ROUTES and request.content_type != "application/json":
            raise OpenAIError(415, f"Content-Type must be application/json, not "
                              f"{request.content_type!r}", code="unsupported_media_type")
        if request.content_type in _SIMPLE_CONTENT_TYPES:
            raise OpenAIError(415, f"{request.path} takes no {request.content_type} body",
                              code="unsupported_media_type")
        origin = request.headers.get("Origin")
        if origin is not None and origin.split("://", 1)[-1] != request.host:
            raise OpenAIError(403, f"cross-origin request from {origin!r} refused",
                              "permission_error", code="cross_origin")
    return await handler(request)


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


def require_key(api_key: str | None):
    """The bearer key on every route but OPEN_ROUTES, compared in constant time (digests of
    equal length, hmac.compare_digest); no check without a key."""
    expected = _digest(f"Bearer {api_key}") if api_key else None

    @web.middleware
    async def check(request: web.Request, handler):
        if expected is not None and request.path not in OPEN_ROUTES:
            given = _digest(request.headers.get("Authorization", ""))
            if not hmac.compare_digest(given, expected):
                raise OpenAIError(401, "invalid or missing API key", "authentication_error",
                                  code="invalid_api_key")
        return await handler(request)

    return check
