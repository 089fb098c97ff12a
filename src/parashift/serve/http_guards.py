"""What every HTTP request passes before its handler: errors turned into OpenAI's error body
(a 500 names its log entry, never the exception), Host names outside the allowlist refused (DNS
rebinding), cross-site requests refused, the API key checked on every route but the liveness
probe and the metrics scrape, and the admin routes' own key on theirs."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import math
import uuid
from collections.abc import Collection

import msgspec
from aiohttp import web

from parashift.serve.engine_errors import EngineDeadError, EngineUnavailableError
from parashift.serve.limits import LOOPBACK_HOSTS, ServeLimits
from parashift.serve.openai_protocol import OpenAIError

logger = logging.getLogger(__name__)

# Without the key: the liveness probe and the Prometheus scrape (counts, never request content).
OPEN_ROUTES = frozenset(("/health", "/metrics"))
JSON_ROUTES = frozenset(("/v1/completions", "/v1/chat/completions"))
# Content types a browser may POST cross-site without asking the server first (CORS "simple").
_SIMPLE_CONTENT_TYPES = frozenset(("text/plain", "application/x-www-form-urlencoded",
                                   "multipart/form-data"))


def _error(error: OpenAIError) -> web.Response:
    response = web.Response(body=msgspec.json.encode(error.body()), status=error.status,
                            content_type="application/json")
    # An error that knows when to come back (a 429 of a full queue) says so: Retry-After in
    # whole seconds (HTTP's), retry-after-ms as the openai clients prefer it (under 1 s).
    retry_after = getattr(error, "retry_after", None)
    if retry_after is not None:
        response.headers["Retry-After"] = str(max(1, math.ceil(retry_after)))
        response.headers["retry-after-ms"] = str(max(1, round(retry_after * 1000)))
    return response


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


def host_name(host: str) -> str:
    """The name of a Host header (or an --allowed-hosts entry) without its port, lower case:
    "LocalHost:8000" -> "localhost", "[::1]:8000" -> "[::1]"."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[:host.find("]") + 1] if "]" in host else host
    name, colon, port = host.rpartition(":")
    # one colon: name:port; more than one: a bare IPv6 address (no port can be told apart)
    return name if colon and ":" not in name and port.isdigit() else host


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host_name(host).strip("[]"))
    except ValueError:
        return None


def _is_loopback(bind_host: str) -> bool:
    address = _address(bind_host)
    return host_name(bind_host) == "localhost" or (address is not None and address.is_loopback)


def allowed_hosts(limits: ServeLimits) -> frozenset[str] | None:
    """The Host names served (None: any). A loopback bind serves only the loopback names and
    --allowed-hosts: a page whose name an attacker rebinds to 127.0.0.1 sends its own name. A
    wider bind serves any Host unless --allowed-hosts names them (the loopback names then
    too). The address bound is always its own name."""
    if not limits.allowed_hosts and not _is_loopback(limits.bind_host):
        return None
    names = {*LOOPBACK_HOSTS, *(host_name(h) for h in limits.allowed_hosts)}
    bound, address = host_name(limits.bind_host), _address(limits.bind_host)
    if bound and not (address is not None and address.is_unspecified):  # not every interface
        names.add(f"[{bound}]" if ":" in bound and not bound.startswith("[") else bound)
    return frozenset(names)


def check_host(names: Collection[str] | None):
    """Refuses (421) a request whose Host is not one of `names`. A request without a Host
    passes: a browser always sends one, so its absence is no rebinding."""

    @web.middleware
    async def check(request: web.Request, handler):
        host = request.headers.get("Host")
        if names is not None and host is not None and host_name(host) not in names:
            raise OpenAIError(421, f"this server does not serve the host name {host!r} "
                              f"(--allowed-hosts adds names)", "invalid_request_error",
                              code="host_not_allowed")
        return await handler(request)

    return check


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
        # Sound because check_host vouches for Host: after a DNS rebinding both would name
        # the attacker's site, and check_host has refused that Host already.
        origin = request.headers.get("Origin")
        if origin is not None and origin.split("://", 1)[-1].lower() != request.host.lower():
            raise OpenAIError(403, f"cross-origin request from {origin!r} refused",
                              "permission_error", code="cross_origin")
    return await handler(request)


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


def require_key(api_key: str | None, admin_key: str | None = None,
                admin_routes: Collection[str] = ()):
    """The bearer key on every route but OPEN_ROUTES, compared in constant time (digests of
    equal length, hmac.compare_digest); no check without a key. With an admin key, the
    admin routes take that key and no other: whoever may generate may not put every engine
    to sleep (the inference key there is a 403)."""
    expected = _digest(f"Bearer {api_key}") if api_key else None
    admin = _digest(f"Bearer {admin_key}") if admin_key else None

    @web.middleware
    async def check(request: web.Request, handler):
        if request.path in OPEN_ROUTES:
            return await handler(request)
        given = _digest(request.headers.get("Authorization", ""))
        if admin is not None and request.path in admin_routes:
            if hmac.compare_digest(given, admin):
                return await handler(request)
            if expected is not None and hmac.compare_digest(given, expected):
                raise OpenAIError(403, f"{request.path} needs the admin key, not the API key",
                                  "permission_error", code="admin_key_required")
            raise OpenAIError(401, "invalid or missing admin key", "authentication_error",
                              code="invalid_api_key")
        if expected is not None and not hmac.compare_digest(given, expected):
            raise OpenAIError(401, "invalid or missing API key", "authentication_error",
                              code="invalid_api_key")
        return await handler(request)

    return check
