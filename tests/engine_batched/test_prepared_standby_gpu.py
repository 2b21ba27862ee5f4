"""The prepared standby on CUDA (cuda backend gpu_manager): its decode graphs, captured over placeholder memory at the
addresses it reserved, replay over the predecessor's weights and KV cache once the takeover maps them there, and give
the tokens the predecessor served; nothing is captured after the takeover."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.batched.__main__ import adopt_prepared, prepare_runner
from libs.common import tokenizer
from libs.common.bus import Bus
from libs.common.config import CommonSettings
from tests.engine.conftest import tiny_weights  # noqa: F401 - fixture
from tests.engine_batched.test_prepared_standby import PROMPT, TOKENS, _served_then_frozen, _standby, greedy
from tests.gpu_manager.conftest import manager_factory  # noqa: F401 - fixture

pytestmark = pytest.mark.gpu
CUDA = ("--device", "cuda")


@pytest.mark.timeout(300)
async def test_graphs_captured_over_placeholders_replay_over_the_predecessors_memory(
        tmp_path: Path, tiny_weights: Path, manager_factory, settings_env: dict[str, str],  # noqa: F811, ANN001
        settings: CommonSettings, bus: Bus) -> None:
    manager = manager_factory(HF_BACKEND="cuda", HF_CHUNK_MIB="2", HF_GRACE_S="30").start()
    env = {**settings_env, "HF_GPU_MANAGER_SOCKET": manager.socket}
    cfg, mcfg, memory, layout_of = _standby(Path(manager.socket), tiny_weights, *CUDA)
    try:
        prepared = prepare_runner(cfg, mcfg, memory, layout_of)
        reserved, runner, info = prepared
        assert info["buckets"] == [1, 2, 4, 8] and runner._graph_for(1) == 1
        played = info["rehearsal"]  # on CUDA by default (rehearsal.py): before the shadow, over the placeholders
        assert "failed" not in played and played["claimed"] == 7 and played["copied"] == 1, played
        graph = runner._graphs[1]
        expected, token = await _served_then_frozen(tmp_path, tiny_weights, env, bus, settings.node, *CUDA)
        loaded = memory.takeover(mcfg, "bat-pred", token, layout_of, 30.0)
        assert memory.client.last_timings_ms["reserved"] == 2
        reused, how = adopt_prepared(prepared, loaded)
        assert reused is runner and how == "reused"
        assert greedy(runner, tokenizer.encode(PROMPT), TOKENS) == expected  # decode steps: graph replays
        assert runner._graphs[1] is graph  # the graph captured before the takeover, not a new one
    finally:
        memory.close()
