"""Bearer-token auth, attached per router: `read` for GETs, `admin` for writes.

No token or an unknown one: 401 (with `WWW-Authenticate: Bearer`). The read-only token on a write: 403.
Tokens are compared in constant time. Every call that needs the admin token is written to the audit record
(audit.py), with its outcome.
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from libs.common.errors import HoldfastError
from services.controller.api.audit import fingerprint
from services.controller.api.context import ctx

bearer = HTTPBearer(auto_error=False, description="admin token, or the read-only token for GET routes")


def token_role(token: str, admin_token: str, read_token: str) -> str | None:
    """"admin", "read" or None (no token, or an unknown one); also used by `guard.py` before any body is read."""
    if token and hmac.compare_digest(token.encode(), admin_token.encode()):
        return "admin"
    if token and read_token and hmac.compare_digest(token.encode(), read_token.encode()):
        return "read"
    return None


def _role(request: Request, creds: HTTPAuthorizationCredentials | None) -> str:
    c = ctx(request)
    token = creds.credentials if creds is not None and creds.scheme.lower() == "bearer" else ""
    role = token_role(token, c.admin_token, c.read_token)
    if role is None:
        raise HTTPException(401, "missing or unknown bearer token", headers={"WWW-Authenticate": "Bearer"})
    return role


def require_read(request: Request, creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> str:
    return _role(request, creds)


async def require_admin(request: Request,
                        creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> AsyncIterator[str]:
    """The admin token, and the call written to the audit record with its outcome (audit.py): a refused
    read token too, since an attempt to change state is what an audit is for."""
    role = _role(request, creds)
    c = ctx(request)
    token = creds.credentials if creds is not None else ""
    who = f"{role} token {fingerprint(token)} from {request.client.host if request.client else '?'}"
    what = f"{request.method} {request.url.path}"
    if role != "admin":
        c.audit.record(who, what, "403")
        raise HTTPException(403, "this token may only read")
    try:
        yield "admin"
    except HTTPException as e:
        c.audit.record(who, what, str(e.status_code))
        raise
    except HoldfastError as e:
        c.audit.record(who, what, e.code)
        raise
    except Exception as e:
        c.audit.record(who, what, f"internal: {type(e).__name__}")
        raise
    else:
        c.audit.record(who, what, "ok")
