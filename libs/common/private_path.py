"""Whether a file or directory is this process's uid's alone to write: the trust a state directory (sockets, the
lease database, credentials) and an artifact's files (weights whose digests are unkeyed) rest on. Pure: it judges a
stat result, the callers lstat or stat and raise their own typed error with their own advice."""

from __future__ import annotations

import os


def not_private(st: os.stat_result) -> str | None:
    """Why a path of stat `st` is not this uid's alone to write (another uid owns it, or group or others may write
    it), or None if it is. Read access is not judged here."""
    if st.st_uid != os.geteuid():
        return f"belongs to uid {st.st_uid}, not to this process's ({os.geteuid()})"
    if st.st_mode & 0o022:
        return f"may be written by others (mode {st.st_mode & 0o7777:o})"
    return None
