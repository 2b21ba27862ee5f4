"""Which event loop a service runs on (libs/common/service.py `loop_factory`): pure logic, a stand-in uvloop."""

from __future__ import annotations

import sys
import types

import pytest

from libs.common.service import loop_factory


@pytest.fixture
def fake_uvloop(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    mod = types.ModuleType("uvloop")
    mod.new_event_loop = lambda: None  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "uvloop", mod)
    return mod


@pytest.mark.parametrize(("chosen", "service", "on"), [
    ("1", "router", True), ("true", None, True), ("router", "router", True), ("controller,router", "router", True),
    ("router", "controller", False), ("router", None, False), ("0", "router", False), ("", "router", False),
])
def test_uvloop_for_every_service_or_the_named_ones(monkeypatch: pytest.MonkeyPatch, fake_uvloop: types.ModuleType,
                                                    chosen: str, service: str | None, on: bool) -> None:
    monkeypatch.setenv("HF_UVLOOP", chosen)
    assert (loop_factory(service) is fake_uvloop.new_event_loop) is on  # type: ignore[attr-defined]


def test_the_stock_loop_where_uvloop_is_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # an import of it raises ImportError
    monkeypatch.setenv("HF_UVLOOP", "1")
    assert loop_factory("router") is None
