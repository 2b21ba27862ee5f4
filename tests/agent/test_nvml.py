"""GPU health through NVML: only where a GPU and nvidia-ml-py are present (run through the device tool)."""

from __future__ import annotations

import asyncio

import pytest

from services.agent.nvml import NvmlWatcher


@pytest.mark.gpu
async def test_nvml_watches_every_visible_gpu_for_xid_and_ecc_events() -> None:
    pytest.importorskip("pynvml")
    seen: list[tuple[int, str]] = []
    watcher = NvmlWatcher(lambda gpu, detail: seen.append((gpu, detail)))
    try:
        assert watcher.start(asyncio.get_running_loop())
        assert watcher.available and watcher.gpus and watcher.gpus[0] == 0
    finally:
        watcher.stop()


async def test_without_nvml_the_watcher_says_so_and_reports_nothing(caplog: pytest.LogCaptureFixture) -> None:
    try:
        import pynvml  # type: ignore[import-not-found]  # noqa: F401

        pytest.skip("NVML is installed here")
    except ImportError:
        pass
    watcher = NvmlWatcher(lambda gpu, detail: None)
    assert not watcher.start(asyncio.get_running_loop())
    assert not watcher.available and "NVML unavailable" in caplog.text
