"""The router against the real reference engine (tiny model, torch): the router's own tests run on the pattern
engine, so this keeps the real contract covered: a stream cut by a SIGKILL resumes on the successor with the
reference engine's resume, and equals its uninterrupted output."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from libs.common.bus import Bus
from libs.common.store import Store
from tests.engine.support import EngineProc, make_tiny_weights
from tests.router.conftest import RouterProc, start_router  # noqa: F401 - the router fixture, used by name
from tests.router.test_router import a_stream_cut_by_a_sigkill_resumes_on_the_successor


async def test_the_router_resumes_a_stream_cut_by_a_sigkill_on_the_reference_engine(
        tmp_path: Path, start_router: Callable[..., RouterProc], bus: Bus, store: Store) -> None:  # noqa: F811
    weights = make_tiny_weights(tmp_path / "tiny.safetensors")
    a, b = (EngineProc(tmp_path, weights, f"ref-{x}", args=("--memory", "local", "--slots", "4")).start()
            for x in "ab")
    try:
        await a_stream_cut_by_a_sigkill_resumes_on_the_successor(a, b, start_router, bus, store)
    finally:
        a.stop()
        b.stop()
