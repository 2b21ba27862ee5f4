"""While NATS is down, nats-py reports each failed reconnect to the error callback, five a second per connection:
every service logged each one (thousands of identical lines in an outage of minutes, probe of 2026-12-07). One line
per distinct error every `NATS_ERROR_EVERY_S` now. A real nats-server (TLS and nkeys), killed."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from libs.common import procs
from libs.common.bus import Bus
from libs.common.config import CommonSettings
from libs.common.ids import new_id


async def test_an_outage_is_a_few_lines_not_one_per_reconnect(tmp_path: Path, nats_conf: Path, credentials: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    port = procs.free_port()
    kids = [procs.nats_server(port, tmp_path / "nats", tmp_path / "nats.log", config=nats_conf).start()]
    procs.wait_port(port, kids[0], timeout=30)
    settings = CommonSettings(credentials_dir=credentials, nats_url=f"nats://127.0.0.1:{port}",
                              subject_prefix=new_id("t").replace("-", ""), state_dir=tmp_path / "state")
    bus = await Bus.connect(settings, "test", stream=False)
    try:
        with caplog.at_level(logging.WARNING, logger="holdfast"):
            kids[0].stop()
            await asyncio.sleep(4)  # ~20 failed reconnects
        errors = [r.getMessage() for r in caplog.records if r.getMessage().startswith("nats error")]
        assert errors and len(errors) <= len(set(errors)) <= 3, errors
    finally:
        await bus.close()
        for k in kids:
            k.stop()
