"""Documented error responses, attached to routes so the OpenAPI schema lists them."""

from __future__ import annotations

from typing import Any

from services.controller.api.schemas import ErrorOut

READ_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorOut, "description": "missing or unknown token"},
    422: {"model": ErrorOut, "description": "invalid parameters"},
}
ONE_ERRORS: dict[int | str, dict[str, Any]] = {**READ_ERRORS, 404: {"model": ErrorOut, "description": "unknown id"}}
WRITE_ERRORS: dict[int | str, dict[str, Any]] = {
    **ONE_ERRORS,
    403: {"model": ErrorOut, "description": "the token's scope is below the route's"},
    409: {"model": ErrorOut, "description": "conflicts with the current state"},
    502: {"model": ErrorOut, "description": "the node refused the command"},
    503: {"model": ErrorOut, "description": "the node did not answer"},
}
