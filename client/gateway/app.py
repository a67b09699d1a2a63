"""The HTTP gateway: a Starlette app that is one more thin client, serving three APIs on
one port (one key, one set of checks, one request path; each API's own module only
translates its requests and answers):

    POST /v1/chat/completions   OpenAI: messages through the model's chat template (the daemon applies it);
                                also as /chat/completions, as llama.cpp's and mlx-lm's servers take it
    POST /v1/completions        OpenAI: a text prompt (or one list of token ids)
    GET  /v1/models             OpenAI: the daemon's model (context length, capabilities), and /v1/models/{id}
    POST /v1/responses          OpenAI's Responses API, stateless, as Codex CLI speaks it (responses.py)
    POST /v1/messages           Anthropic's Messages API, and /v1/messages/count_tokens (anthropic.py)
    /api/...                    Ollama's API: chat, generate, tags, ps, show, version (ollama.py)
    GET  /health                200 when the daemon answers as ready, else 503
    GET  /                      the live dashboard (client/dashboard), polling GET /dashboard/state

Any model name is served by the daemon's model (as llama.cpp's server serves its one
model): an answer names the model its request asked for.

The one request path onto the daemon, which every API module takes, is daemon_link.py;
this module only puts the routes together.

Errors are `ApiError`s (daemon_link.py), answered in the shape of the API whose route was
called: OpenAI's `{"error": {"message", "type", "param", "code"}}`, Anthropic's
`{"type": "error", "error": {"type", "message"}}`, Ollama's `{"error": message}`, with
the HTTP status that says what went wrong.
"""

from __future__ import annotations

import logging

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..dashboard import Dashboard
from . import anthropic, ollama, openai, responses
from .daemon_link import ApiError, Gateway, GatewayConfig
from .guard import GuardConfig, GuardMiddleware

log = logging.getLogger("moestream.openai")


def error_response(request: Request, exc: ApiError, headers: dict[str, str] | None = None) -> Response:
    """`exc` in the shape of the API whose route was called."""
    path = request.url.path
    if anthropic.owns(path):
        body = anthropic.error_body(exc)
    elif ollama.owns(path):
        body = ollama.error_body(exc)
    else:
        body = exc.body()
    return JSONResponse(body, status_code=exc.status, headers=headers)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return error_response(request, exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    error = ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=code)
    return error_response(request, error, exc.headers)


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.error("%s %s failed: %s: %s", request.method, request.url.path, type(exc).__name__, exc)
    return error_response(request, ApiError(500, f"the gateway failed: {type(exc).__name__}", type="server_error"))


def create_app(config: GatewayConfig, guard: GuardConfig | None = None) -> Starlette:
    """The ASGI app of the gateway for the daemon at `config.paths`, behind the request
    guards (client/gateway/guard.py) of `guard` (default: a loopback server's)."""
    gw = Gateway(config)
    routes = [
        Route("/health", gw.health, methods=["GET"]),
        *openai.OpenAIApi(gw).routes(),
        *responses.ResponsesApi(gw).routes(),
        *anthropic.AnthropicApi(gw).routes(),
        *ollama.OllamaApi(gw).routes(),
    ]
    # The live dashboard (client/dashboard): GET / and its JSON route; its lifespan samples
    # the daemon's tokens made for the history it draws.
    dashboard = Dashboard(config.paths, gw._authorize)
    routes += dashboard.routes()
    handlers = {ApiError: _api_error, HTTPException: _http_error, Exception: _internal_error}
    middleware = [Middleware(GuardMiddleware, config=guard or GuardConfig())]
    return Starlette(routes=routes, exception_handlers=handlers, middleware=middleware, lifespan=dashboard.lifespan)
