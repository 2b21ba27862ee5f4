"""The state directory (sockets, the lease database, tokens, credentials) is this uid's and closed to others: one
made before with a looser mode is closed (it kept 0755 for good), one others may write in, or another uid's, is
refused. Real directories."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from libs.common.config import CommonSettings


def _mode(p: Path) -> int:
    return p.stat().st_mode & 0o7777


def test_a_new_state_dir_is_made_closed_and_a_loose_one_is_closed(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    fresh = tmp_path / "a" / "state"
    assert CommonSettings(state_dir=fresh).ensure_state_dir() == fresh and _mode(fresh) == 0o700
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o755)
    (loose / "kept").write_text("x")
    with caplog.at_level(logging.WARNING, logger="holdfast.config"):
        CommonSettings(state_dir=loose).ensure_state_dir()
    assert _mode(loose) == 0o700 and (loose / "kept").read_text() == "x"
    assert "was open to others (mode 755): now 0700" in caplog.text
    caplog.clear()
    CommonSettings(state_dir=loose).ensure_state_dir()  # closed already: nothing to say
    assert not caplog.text


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o770])
def test_a_state_dir_others_may_write_in_is_refused_and_left_as_it_was(tmp_path: Path, mode: int) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)
    with pytest.raises(PermissionError, match="may be written by others"):
        CommonSettings(state_dir=shared).ensure_state_dir()
    assert _mode(shared) == mode


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another uid needs root")
def test_another_uids_state_dir_is_refused(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(PermissionError, match="belongs to uid 65534"):
        CommonSettings(state_dir=theirs).ensure_state_dir()
