"""Bearer-token auth, attached per route: `require_read` for GETs, `require_operate` and `require_admin` for
writes (scopes and their order: tokens.py).

No token or an unknown one: 401 (with `WWW-Authenticate: Bearer`). A token whose scope is below the route's:
403. Tokens are looked up by hash in constant time (tokens.py). Every call that needs `operate` or `admin` is
written to the audit record (audit.py) with its outcome, a refused lower-scope token too.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Depends, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from libs.common.errors import HoldfastError
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


def audited(needed: str) -> Callable[..., Any]:
    """A dependency admitting tokens of scope `needed` or higher, writing the call and its outcome to the
    audit record: a refused lower scope too, since an attempt to change state is what an audit is for."""

    async def dependency(request: Request,
                         creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> AsyncIterator[str]:
        token = _token(creds)
        scope = _scope(request, token)
        c = ctx(request)
        who = f"{scope} token {fingerprint(token)} from {request.client.host if request.client else '?'}"
        what = f"{request.method} {request.url.path}"
        if not allows(scope, needed):
            c.audit.record(who, what, "403")
            raise HTTPException(403, f"this needs a token of scope {needed}; this one is {scope}")
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
    return dependency


require_operate = audited("operate")
require_admin = audited("admin")
