"""Bearer-token auth, attached per router: `read` for GETs, `admin` for writes.

No token or an unknown one: 401 (with `WWW-Authenticate: Bearer`). The read-only token on a write: 403.
Tokens are compared in constant time.
"""

from __future__ import annotations

import hmac

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from services.controller.api.context import ctx

bearer = HTTPBearer(auto_error=False, description="admin token, or the read-only token for GET routes")


def _role(request: Request, creds: HTTPAuthorizationCredentials | None) -> str:
    c = ctx(request)
    token = creds.credentials if creds is not None and creds.scheme.lower() == "bearer" else ""
    if token and hmac.compare_digest(token.encode(), c.admin_token.encode()):
        return "admin"
    if token and c.read_token and hmac.compare_digest(token.encode(), c.read_token.encode()):
        return "read"
    raise HTTPException(401, "missing or unknown bearer token", headers={"WWW-Authenticate": "Bearer"})


def require_read(request: Request, creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> str:
    return _role(request, creds)


def require_admin(request: Request, creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> str:
    if _role(request, creds) != "admin":
        raise HTTPException(403, "this token may only read")
    return "admin"
