"""Files out of the page cache, so that a timed read goes to the disk (bench restore and its first-token part, the
demo's and bench recovery's cold restart): only those files' pages, nothing else of the machine's cache."""

from __future__ import annotations

import os
from pathlib import Path


def drop_cache(paths: list[Path]) -> None:
    """Each file written back (a dirty page is not dropped) and its clean pages dropped (POSIX_FADV_DONTNEED)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
