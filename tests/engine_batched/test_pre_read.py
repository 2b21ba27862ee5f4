"""A successor's journal pre-read (engines/batched/shadow.py): read without writing while the predecessor may still
write, used by `build_engine` only if the journal it then owns is unchanged, read again otherwise."""

from __future__ import annotations

from pathlib import Path

import torch

from engines.batched.__main__ import build_engine
from engines.batched.config import parse_config
from engines.batched.journal import CHECK, Journal
from engines.batched.live import Request
from engines.batched.memory import Loaded
from engines.batched.shadow import PreRead
from engines.reference.config import get_config
from engines.reference.weights import make_weights
from tests.engine_batched.test_engine_adoption import LAYOUT, ListSink, engine, memory

CFG = get_config("tiny")


def _serving(tmp_path: Path, steps: int):  # noqa: ANN202
    """A predecessor with two sequences, `steps` steps in: its weights, KV cache and journal, and itself."""
    weights, kv, jr = memory(tmp_path)
    first = engine(weights, kv, jr)
    first.journal.format()
    for i, prompt in enumerate(([1, 5, 9, 13, 17], [2, 4, 6])):
        first.submit(Request(f"r{i}", prompt, 60, 0.0, 0, True, ListSink()))
    first._drain()
    for _ in range(steps):
        first.step()
    return weights, kv, jr, first


def _successor(tmp_path: Path, weights, kv, jr, pre: PreRead | None):  # noqa: ANN001, ANN202
    cfg = parse_config(["--weights", str(make_weights(CFG, tmp_path / "w.safetensors", seed=4)), "--size", "tiny",
                        "--deterministic", "--block-size", str(LAYOUT.block_size), "--num-blocks",
                        str(LAYOUT.num_blocks), "--max-num-seqs", str(LAYOUT.slots), "--max-model-len",
                        str(LAYOUT.max_len), "--device", "cpu", "--memory", "local"])
    loaded = Loaded(weights, kv, jr, "takeover", True, LAYOUT)
    return build_engine(cfg, CFG, loaded, LAYOUT, capture_now=False, pre=pre)


def _tokens(eng) -> dict[str, list[int]]:  # noqa: ANN001
    return {live.seq.request_id: list(live.seq.tokens) for live in eng.table.live.values()}


def test_a_read_writes_nothing_even_where_a_row_was_cut_off_mid_admission(tmp_path: Path) -> None:
    _, _, jr, _ = _serving(tmp_path, 3)
    journal = Journal(LAYOUT, jr)
    jr["jr_rows"][5, 0] = 99  # a row whose admission never got its check
    before = {n: t.clone() for n, t in jr.items()}
    read = journal.read()
    assert read.dropped == [5] and len(read.entries) == 2
    assert all(torch.equal(before[n], jr[n]) for n in jr)  # a pre-read happens while another engine owns these
    journal.take(read)
    assert int(jr["jr_rows"][5, 0]) == 0 and int(jr["jr_rows"][5, CHECK]) == 0  # emptied once it is ours


def test_an_unchanged_journal_is_adopted_as_the_pre_read_found_it(tmp_path: Path) -> None:
    weights, kv, jr, _ = _serving(tmp_path, 4)
    pre = PreRead("pred", Journal(LAYOUT, jr).read(), 0.0, 0.0)
    eng, info = _successor(tmp_path, weights, kv, jr, pre)
    assert info["pre_read"] == "used" and info["adopted"] == 2
    assert _tokens(eng) == {e.request_id: e.tokens for e in pre.read.entries}


def test_a_journal_written_after_the_pre_read_is_read_again(tmp_path: Path) -> None:
    weights, kv, jr, first = _serving(tmp_path, 4)
    pre = PreRead("pred", Journal(LAYOUT, jr).read(), 0.0, 0.0)
    first.step()  # the predecessor's last step lands after the read (a CUDA stream's queued writes do)
    first.step()
    now = {e.request_id: e.tokens for e in Journal(LAYOUT, jr).read().entries}
    assert now != {e.request_id: e.tokens for e in pre.read.entries}
    eng, info = _successor(tmp_path, weights, kv, jr, pre)
    assert info["pre_read"] == "stale" and info["adopted"] == 2
    assert _tokens(eng) == now  # the committed state as it is now, not as it was read
