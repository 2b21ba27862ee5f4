"""The admin API app: routers wired, errors mapped to JSON bodies (served on its own thread: `server.py`)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from libs.common.errors import (
    CommandTimeout,
    Conflict,
    HoldfastError,
    InvalidTransition,
    NotFound,
    RemoteError,
    StaleEpoch,
    Unavailable,
)
from libs.common.web.guard import RequestGuard
from services.controller.api.auth import audit_refused, audit_unparsed
from services.controller.api.context import ApiContext
from services.controller.api.routers import engines, gpus, incidents, leases, nodes, system

STATUS_OF: dict[type[HoldfastError], int] = {NotFound: 404, Conflict: 409, InvalidTransition: 409,
                                             StaleEpoch: 409, Unavailable: 503, CommandTimeout: 503}
# A node's typed refusal maps as the same error raised here would (a node's command timing out is a 503, as a
# local one is); a code no table names is the node refusing: 502.
REMOTE_STATUS = {t.code: s for t, s in STATUS_OF.items()}


# A refused body's errors listed in its 422 at most: each was (a 1 MB body of 100,000 unknown fields got an 8.9 MB
# answer, seconds of the controller process's CPU beside the incident pipeline)
MAX_DETAIL = 20


def _error(status: int, code: str, message: str, detail: list | None = None,
           headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": code, "message": message, "detail": detail}
    return JSONResponse(jsonable_encoder(body), status_code=status, headers=headers)


def create_app(ctx: ApiContext) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.ctx = ctx
        yield

    app = FastAPI(title="Holdfast controller", version="1", lifespan=lifespan,
                  description="Cluster view, incidents and operations of a Holdfast cluster.")
    app.state.ctx = ctx  # also without a lifespan run (in-process test clients)
    for r in (nodes.router, gpus.router, engines.router, leases.router, incidents.router, system.router):
        app.include_router(r)
    # Token and body size are checked from the headers, before any body byte is read (guard.py).
    app.add_middleware(RequestGuard, tokens=ctx.tokens, max_body_bytes=ctx.settings.api_max_body_bytes,
                       on_refused=lambda scope, status: audit_refused(ctx.audit, ctx.tokens, scope, status))
    # CORS only where configured, outside the guard (a browser's preflight carries no token). Without it no
    # response has CORS headers, so a page on another origin cannot read the API with a user's token.
    origins = [o.strip() for o in ctx.settings.api_cors_origins.split(",") if o.strip()]
    if origins:
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["GET", "POST"],
                           allow_headers=["authorization", "content-type"])

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        if (refused := await audit_unparsed(request, 422)) is not None:  # a body FastAPI could not parse
            return await http_error(request, refused)
        found = exc.errors()
        errs = [{"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")}
                for e in found[:MAX_DETAIL]]
        summary = "; ".join(f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}" for e in errs[:5])
        if len(found) > MAX_DETAIL:
            summary += f" (and {len(found) - MAX_DETAIL} more errors not listed)"
        return _error(422, "validation_error", summary or "invalid request", errs)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if (refused := await audit_unparsed(request, exc.status_code)) is not None:  # e.g. a body it cannot decode
            exc = refused
        code = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found",
                405: "method_not_allowed"}.get(exc.status_code, "error")
        return _error(exc.status_code, code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(HoldfastError)
    async def holdfast_error(_: Request, exc: HoldfastError) -> JSONResponse:
        if isinstance(exc, RemoteError):
            return _error(REMOTE_STATUS.get(exc.remote_code, 502), exc.remote_code, exc.message)
        status = next((s for t, s in STATUS_OF.items() if isinstance(exc, t)), 500)
        return _error(status, exc.code, exc.message)

    @app.exception_handler(Exception)
    async def internal(_: Request, exc: Exception) -> JSONResponse:
        # What no handler above types (a bug, a connection gone under a route): the same JSON shape, the type of the
        # failure only (no detail that could carry state); Starlette logs the traceback after this answer.
        return _error(500, "internal", f"internal error ({type(exc).__name__}); the controller's log has the detail")

    return app
