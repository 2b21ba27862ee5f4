"""The chaos run's engine scan (bench/chaos_faults.EngineScan) finds engines by their environment, reading only
new processes: real processes here, one of them an engine only after its exec."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from bench.chaos_faults import EngineScan


def _spawn(env: dict[str, str], script: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sh", "-c", script], env={"PATH": os.environ["PATH"], **env})


def test_an_engine_is_found_with_its_model_and_others_are_not(tmp_path: Path) -> None:
    state = str(tmp_path / "state")
    engine = _spawn({"HF_STATE_DIR": state, "HF_ENGINE_ID": "e-1", "HF_MODEL": "demo-2"}, "exec sleep 30")
    other_stack = _spawn({"HF_STATE_DIR": state + "-other", "HF_ENGINE_ID": "e-2", "HF_MODEL": "demo"}, "exec sleep 30")
    service = _spawn({"HF_STATE_DIR": state}, "exec sleep 30")  # the stack's, but no engine
    try:
        scan = EngineScan(Path(state))
        deadline = time.monotonic() + 10
        while engine.pid not in scan.scan() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert scan.scan() == {engine.pid}
        assert scan.scan("demo-2") == {engine.pid}
        assert scan.scan("demo") == set()
    finally:
        for p in (engine, other_stack, service):
            p.kill()
            p.wait()
    assert engine.pid not in scan.scan()  # gone: forgotten


def test_a_process_that_becomes_an_engine_by_its_exec_is_found_after_it(tmp_path: Path) -> None:
    state = str(tmp_path / "state")
    # forked by the agent: the agent's environment until the exec, the engine's after it
    late = _spawn({"HF_STATE_DIR": state}, f"sleep 0.6; exec env HF_ENGINE_ID=e-3 HF_MODEL=demo {sys.executable} "
                                            "-c 'import time; time.sleep(30)'")
    try:
        scan = EngineScan(Path(state), recheck_s=0.1)
        assert late.pid not in scan.scan()  # not yet an engine: remembered as such, for recheck_s
        deadline = time.monotonic() + 10
        while late.pid not in scan.scan() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert late.pid in scan.scan("demo")
    finally:
        late.kill()
        late.wait()
