"""Files out of the page cache, so that a timed read goes to the disk (bench restore and its first-token part)."""

from __future__ import annotations

import os
from pathlib import Path


def drop_cache(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
