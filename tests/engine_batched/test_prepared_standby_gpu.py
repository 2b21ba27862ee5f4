"""The prepared standby on CUDA (cuda backend gpu_manager): its decode graphs, captured over placeholder memory at the
addresses it reserved, replay over the predecessor's weights and KV cache once the takeover maps them there, and give
the tokens the predecessor served; nothing is captured after the takeover."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engines.batched.__main__ import adopt_prepared, prepare_page, prepare_runner
from engines.batched.drain import DONE, DRAIN_NAME, LAUNCHED, PageLayout, open_drain
from engines.batched.memory import journal_generation
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


@pytest.mark.timeout(300)
async def test_a_standbys_drain_page_is_registered_before_the_takeover_and_its_mark_takes_it_over(
        tmp_path: Path, tiny_weights: Path, manager_factory, settings_env: dict[str, str],  # noqa: F811, ANN001
        settings: CommonSettings, bus: Bus) -> None:
    """drain.py `ready_page`: the standby's own page, leased and registered while it stands by, is its mark's after
    the takeover (nothing registered on the way), and the page its predecessor handed on (read by the fence) is
    released; the mark's `done` still follows its queue into the page."""
    manager = manager_factory(HF_BACKEND="cuda", HF_CHUNK_MIB="2", HF_GRACE_S="30").start()
    env = {**settings_env, "HF_GPU_MANAGER_SOCKET": manager.socket}
    cfg, mcfg, memory, layout_of = _standby(Path(manager.socket), tiny_weights, *CUDA)
    device = torch.device("cuda")
    try:
        prepared = prepare_runner(cfg, mcfg, memory, layout_of)
        ready = prepare_page(cfg, memory, prepared[0].layout, device)
        assert ready is not None and ready.page.is_pinned()
        _, token = await _served_then_frozen(tmp_path, tiny_weights, env, bus, settings.node, *CUDA)
        loaded = memory.takeover(mcfg, "bat-pred", token, layout_of, 30.0, known=prepared[0])
        pages = [lz.id for lz in memory.client.leases.values() if any(m.name == DRAIN_NAME for m in lz.tensor_metas)]
        assert loaded.drain is not None and ready.lease_id in pages and len(pages) == 2  # its own, the handed-on one
        prior = journal_generation(loaded)
        gen = 1 if prior is None else prior + 1
        mark = open_drain(memory.client, loaded.drain, device, PageLayout(loaded.layout.slots, loaded.layout.num_blocks),
                          gen, ready)
        assert mark.page is ready.page and mark.registered
        assert [lz for lz in memory.client.leases if lz in pages] == [ready.lease_id]
        mark.close()  # start-up's bracket: `done` follows in stream order
        torch.cuda.synchronize()
        assert mark.bank[DONE] == mark.bank[LAUNCHED] == 1
        mark.stop()
        assert not ready.page.is_pinned()
    finally:
        memory.close()
