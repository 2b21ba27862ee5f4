"""Bearer-token auth, attached per route: `require_read` for GETs, `require_operate` and `require_admin` for
writes (scopes and their order: tokens.py).

No token or an unknown one: 401 (with `WWW-Authenticate: Bearer`). A token whose scope is below the route's:
403. Tokens are looked up by hash in constant time (tokens.py). Every call that needs `operate` or `admin` is
written to the audit record (audit.py) with its outcome, a refused lower-scope token too, exactly once: by the
route's `audited` dependency, or, for a body FastAPI refused before any dependency ran (it parses the body first),
by `audit_unparsed` from the app's error handlers, which also answers a lower scope's 403 in place of the parse error.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, MutableMapping
from typing import Any

from fastapi import Depends, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from libs.common.errors import HoldfastError
from libs.common.web.guard import bearer_token
from libs.common.web.tokens import allows
from services.controller.api.audit import fingerprint
from services.controller.api.context import ctx

bearer = HTTPBearer(auto_error=False, description="a token of scope read (GET routes), operate or admin")


def _token(creds: HTTPAuthorizationCredentials | None) -> str:
    return creds.credentials if creds is not None and creds.scheme.lower() == "bearer" else ""


def _scope(request: Request, token: str) -> str:
    scope = ctx(request).tokens.scope_of(token)
    if scope is None:
        raise HTTPException(401, "missing or unknown bearer token", headers={"WWW-Authenticate": "Bearer"})
    return scope


def require_read(request: Request, creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> str:
    """Any known token; returns its scope (a route may ask for more, as the audit listing does)."""
    return _scope(request, _token(creds))


def _caller(request: Request, token: str, scope: str) -> tuple[str, str]:
    """(who, what) of an audit entry."""
    who = f"{scope} token {fingerprint(token)} from {request.client.host if request.client else '?'}"
    return who, f"{request.method} {request.url.path}"


def _below(scope: str, needed: str) -> HTTPException:
    return HTTPException(403, f"this needs a token of scope {needed}; this one is {scope}")


def needed_scope(route: Any) -> str | None:
    """The scope the route's `audited` dependency asks for; None: the route writes nothing."""
    for dep in getattr(route, "dependencies", ()):
        needed = getattr(dep.dependency, "needed", None)
        if needed is not None:
            return str(needed)
    return None


async def audit_unparsed(request: Request, status: int) -> HTTPException | None:
    """A write call refused before its dependencies ran (FastAPI parses the body first: invalid JSON is a 422, bytes
    it cannot decode a 400), so `audited` never saw it: recorded here with that outcome, or, for a token below the
    route's scope, as the 403 it is, which is returned for the handler to answer instead. A call `audited` saw
    already (it marks the request) is not recorded twice."""
    route = request.scope.get("route")
    needed = needed_scope(route) if request.method in getattr(route, "methods", ()) else None
    if needed is None or getattr(request.state, "audited", False):
        return None
    token = _token(await bearer(request))
    scope = ctx(request).tokens.scope_of(token)
    if scope is None:  # the guard answered 401 before the app (guard.py)
        return None
    request.state.audited = True
    who, what = _caller(request, token, scope)
    if not allows(scope, needed):
        ctx(request).audit.record(who, what, "403")
        return _below(scope, needed)
    ctx(request).audit.record(who, what, str(status))
    return None


def audit_refused(audit: Any, tokens: Any, scope: MutableMapping[str, Any], status: int) -> None:
    """A call the guard refused before the app saw it (guard.py: a body over the limit, 413; a bad length, 400): an
    authenticated token's attempt to change state is recorded with that outcome, as `audited` records what reaches a
    route. The API's writes are its POSTs (every one audited: routers/); a read (GET) is not recorded."""
    if scope.get("method") in ("GET", "HEAD", "OPTIONS"):
        return
    token = bearer_token(dict(scope["headers"]))
    scope_name = tokens.scope_of(token) if token is not None else None
    if token is None or scope_name is None:
        return
    request = Request(scope)
    who, what = _caller(request, token, scope_name)
    audit.record(who, what, str(status))
    # refused while its body came (413 counted mid-body): the app then reads a disconnect, refused again as a body
    # it cannot parse (`audit_unparsed`), which must not record the call a second time
    request.state.audited = True


def audited(needed: str) -> Callable[..., Any]:
    """A dependency admitting tokens of scope `needed` or higher, writing the call and its outcome to the
    audit record: a refused lower scope too, since an attempt to change state is what an audit is for."""

    async def dependency(request: Request,
                         creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> AsyncIterator[str]:
        token = _token(creds)
        scope = _scope(request, token)
        c = ctx(request)
        request.state.audited = True  # recorded here, whatever follows (audit_unparsed)
        who, what = _caller(request, token, scope)
        if not allows(scope, needed):
            c.audit.record(who, what, "403")
            raise _below(scope, needed)
        try:
            yield scope
        except HTTPException as e:
            c.audit.record(who, what, str(e.status_code))
            raise
        except HoldfastError as e:
            c.audit.record(who, what, e.code)
            raise
        except RequestValidationError:  # a bad body or query: the client's error, not the service's
            c.audit.record(who, what, "422")
            raise
        except Exception as e:
            c.audit.record(who, what, f"internal: {type(e).__name__}")
            raise
        else:
            c.audit.record(who, what, "ok")

    dependency.__name__ = f"require_{needed}"
    setattr(dependency, "needed", needed)  # noqa: B010 - what `needed_scope` reads off a route
    return dependency


require_operate = audited("operate")
require_admin = audited("admin")
