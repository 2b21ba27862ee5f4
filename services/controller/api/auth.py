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


def require_admin(request: Request, creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> str:
    if _role(request, creds) != "admin":
        raise HTTPException(403, "this token may only read")
    return "admin"
