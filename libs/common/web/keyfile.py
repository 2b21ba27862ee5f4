"""A plain token made once into a file of the state directory (0600, created exclusively), for a service started
with no token configured: the admin API's `controller-admin-token`, the router's `router-api-key`. Whoever may read
the file (its user) holds the token; the token itself is never logged."""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path

log = logging.getLogger("holdfast.web")


def token_file(path: Path, what: str) -> str:
    """The token in `path`, made (256 random bits, URL-safe) if there is none yet."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    else:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32))
        log.info("generated %s into %s", what, path)
    token = path.read_text().strip()
    if not token:
        raise ValueError(f"{path} ({what}) is empty: remove it to have one generated, or write a token into it")
    return token
