"""limit/offset pagination shared by every list route (stable order: the caller sorts first)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from fastapi import Query

from services.controller.api.schemas import Page

T = TypeVar("T")


@dataclass(frozen=True)
class PageParams:
    limit: int
    offset: int


def page_params(limit: int = Query(100, ge=1, le=1000, description="items per page"),
                offset: int = Query(0, ge=0, le=10_000_000, description="items to skip")) -> PageParams:
    return PageParams(limit, offset)


def paginate(items: Sequence[T], p: PageParams) -> Page[T]:
    chunk = list(items[p.offset:p.offset + p.limit])
    nxt = p.offset + p.limit if p.offset + p.limit < len(items) else None
    return Page[T](items=chunk, total=len(items), limit=p.limit, offset=p.offset, next_offset=nxt)
