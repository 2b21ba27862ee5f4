"""Bearer tokens (the admin API's, the router's API keys): kept as hashes, matched in constant time, each with a
scope. Pure (no I/O).

The admin API's scopes are ordered: `read` (GET routes) < `operate` (failover, drain, snapshot) < `admin`
(upgrade, reclaim, the audit record, everything). A token may do what its scope and every lower scope may. The
router's keys have one scope, `infer` (`ROUTER_SCOPES`): a table is parsed for the scopes of its API, so an admin
entry is refused as a router key and the other way round.

Hash: SHA-256 of the token, not a password hash (scrypt, argon2). The tokens we issue are 256 random bits
(`new_token`), so a preimage search is out of reach without key stretching; a slow hash would instead cost
every request tens of milliseconds of CPU, checked before any body is read (guard.py), which turns the
authentication step into a denial-of-service lever. A low-entropy token (the dev stack's fixed one) gets no
such protection: it is for loopback development only.

Invariants: a table holds digests, never a token; a lookup hashes the presented token and compares it with
every digest (`same_digest`, `hmac.compare_digest`), so the time taken does not depend on which entry, or how
much of one, matched.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass

SCOPES = ("read", "operate", "admin")
ROUTER_SCOPES = ("infer",)
RANK = {s: i for i, s in enumerate(SCOPES)}
TOKEN_BYTES = 32  # 256 bits: see the docstring on why SHA-256 is then enough


def _entry(scopes: tuple[str, ...]) -> re.Pattern[str]:
    return re.compile(rf"({'|'.join(map(re.escape, scopes))}):sha256:([0-9a-f]{{64}})")


class TokenConfigError(ValueError):
    """A hashed-token entry that does not parse (settings `api_tokens`)."""


def digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def same_digest(a: bytes, b: bytes) -> bool:
    """The one comparison of secrets in this module: constant time for equal-length inputs."""
    return hmac.compare_digest(a, b)


def entry_for(scope: str, token: str) -> str:
    """The settings entry (`<scope>:sha256:<hex>`) that admits `token` with `scope`."""
    if scope not in SCOPES + ROUTER_SCOPES:
        raise TokenConfigError(f"unknown scope {scope!r} (one of {', '.join(SCOPES + ROUTER_SCOPES)})")
    return f"{scope}:sha256:{digest(token).hex()}"


def new_token(scope: str) -> tuple[str, str]:
    """A fresh token and its settings entry: the token goes to its holder, only the entry to the config."""
    token = secrets.token_urlsafe(TOKEN_BYTES)
    return token, entry_for(scope, token)


def allows(scope: str, needed: str) -> bool:
    return RANK[scope] >= RANK[needed]


@dataclass(frozen=True)
class TokenTable:
    entries: tuple[tuple[bytes, str], ...] = ()  # (SHA-256 digest, scope)
    scopes: tuple[str, ...] = SCOPES  # this API's, lowest first

    @classmethod
    def parse(cls, spec: str, scopes: tuple[str, ...] = SCOPES) -> TokenTable:
        """`<scope>:sha256:<64 hex>` entries separated by commas or new lines (a file of them, as a Kubernetes Secret
        mounts it); raises `TokenConfigError` on any other, or on a scope not of `scopes`."""
        entries = []
        pattern = _entry(scopes)
        for raw in (p.strip() for p in spec.replace("\n", ",").split(",")):
            if not raw:
                continue
            m = pattern.fullmatch(raw)
            if m is None:
                shown = raw.split(":", 1)[0]  # never echo what may be a token pasted by mistake
                raise TokenConfigError(f"a token entry starting {shown!r}:... is not '<scope>:sha256:<64 hex>' "
                                       f"(scope one of {', '.join(scopes)}; `holdfast api-token` prints one)")
            entries.append((bytes.fromhex(m.group(2)), m.group(1)))
        return cls(tuple(entries), scopes)

    def with_plain(self, admin_token: str = "", read_token: str = "") -> TokenTable:
        """The admin API's dev tokens (settings `admin_token`, `read_token`): `with_token` of each."""
        return self.with_token(admin_token, "admin").with_token(read_token, "read")

    def with_token(self, token: str, scope: str) -> TokenTable:
        """One plain token more (a dev stack's), hashed at once; an empty one adds nothing."""
        return TokenTable(self.entries + ((digest(token), scope),), self.scopes) if token else self

    def scope_of(self, token: str) -> str | None:
        """The highest scope `token` holds, or None (no token, or an unknown one)."""
        if not token:
            return None
        d = digest(token)
        found: str | None = None
        for stored, scope in self.entries:  # every entry compared: no early exit on a match
            if same_digest(d, stored) and (found is None or self.scopes.index(scope) > self.scopes.index(found)):
                found = scope
        return found
