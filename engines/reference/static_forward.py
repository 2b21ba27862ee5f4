"""Fixed-shape forwards, replayed as CUDA graphs: one token at any position, and a prompt's first chunk
padded to the chunk size.

Why: the eager forward is launch-bound (~44 kernels a layer: a 16 GiB model's decode step or short prefill
takes 34-39 ms on an H200 whose GPU works a few ms of it; replayed, 10-12 ms; docs/engine.md). A graph
replays every launch of a forward as one. Graphs need fixed shapes and addresses, so here the position is a
device tensor, the new keys and values are written with `index_copy_` at it, and a decode step attends the
whole cache slot with a mask (positions after the query's are never read, whatever they hold); a first chunk
attends its own positions only.

Invariants:
1. With `graphs` on, every one-token forward and every first prompt chunk take this path, on both sides
   of a takeover (the setting, like `prefill_chunk`, must agree), so exact resume (engine.py invariant 1)
   holds within it. Its logits differ from the eager path's in the last bits, never between runs.
2. A padded row never changes a real one: row i attends positions <= i only, and rows are computed
   independently; the padding's keys and values, written after the prompt's end, are overwritten by the
   next tokens before any query can read them.
3. Without CUDA (or before `capture`), the same kernels run eagerly: the same numbers, only slower.
4. The cache starts zeroed (but for slots inherited in place, which hold only values forwards wrote): a hidden
   position is read with weight 0, and 0 x NaN is NaN.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from engines.reference.kv_reuse import SlotMarks
from engines.reference.model import Transformer


class StaticForward:
    def __init__(self, model: Transformer, kv: torch.Tensor, chunk: int, marks: SlotMarks | None = None,
                 keep: Sequence[int] = ()) -> None:
        self.model, self.kv, self.chunk, self.marks = model, kv, chunk, marks
        dev = model.device
        self.token = torch.zeros(1, dtype=torch.long, device=dev)
        self.position = torch.zeros(1, dtype=torch.long, device=dev)
        self.prompt = torch.zeros(chunk, dtype=torch.long, device=dev)
        self.prompt_positions = torch.arange(chunk, device=dev)
        self.key_positions = torch.arange(kv.shape[4], device=dev)
        self.graphs: dict[tuple[str, int], tuple[Any, torch.Tensor]] = {}
        # Hidden positions are read (and weighted 0): 0 x NaN would still be NaN, and leased memory holds
        # whatever its last owner left. This cache starts zeroed (its marks vouch for nothing: kv_reuse.py), but
        # for the slots `keep` inherited from a predecessor that zeroed them in turn and wrote only forwards'
        # values since (kv_reuse.py invariant 5); the rest of what carries over a takeover is copied in.
        for slot in range(kv.shape[0]):
            if slot not in keep:
                kv[slot].zero_()

    def decode(self, slot: int, token: int, position: int) -> torch.Tensor:
        """Logits ([1, vocab], float32, a tensor of the caller's) of `token` at `position`."""
        self.token.fill_(token)  # a kernel argument: no host-to-device copy
        self.position.fill_(position)
        return self._run("decode", slot).clone()

    def first_chunk(self, slot: int, tokens: list[int]) -> torch.Tensor:
        """Logits ([1, vocab]) of the last of `tokens`, a prompt's first chunk (positions from 0)."""
        n = len(tokens)
        if not 0 < n <= self.chunk:
            raise ValueError(f"a first chunk holds 1 to {self.chunk} tokens, not {n}")
        self.prompt.copy_(torch.tensor(tokens + [0] * (self.chunk - n), dtype=torch.long))
        return self._run("chunk", slot)[n - 1:n].clone()

    def capture(self, slots: int, lock: Any) -> None:
        """Record both forwards of every slot as CUDA graphs (CUDA only; nothing to do elsewhere). Each capture
        takes `lock` (the engine's forward lock) on its own, so an engine already serving captures between its
        requests' forwards."""
        if self.model.device.type != "cuda":
            return
        pool = torch.cuda.graph_pool_handle()
        for slot in range(slots):
            for kind in ("decode", "chunk"):
                with lock:
                    self._capture_one(kind, slot, pool)

    def _capture_one(self, kind: str, slot: int, pool: Any) -> None:
        dev = self.model.device
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):  # kernels loaded, cuBLAS workspaces made, before the capture
                self.warm_up(kind, slot)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA call meanwhile (a sampled token's copy to the host) is not
        # captured and does not invalidate the capture. A capture runs nothing: it writes no cache.
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            out = self._compute(kind, slot)
        torch.cuda.synchronize(dev)
        self.graphs[(kind, slot)] = (graph, out)

    def warm_up(self, kind: str, slot: int) -> None:
        """Run one forward of `kind` on `slot` as a capture's warm-up, leaving the slot's cache as it was.
        Why: it writes keys and values of whatever its inputs last held (another request's prompt, another
        slot's token) at the chunk's positions or the last decode position; an engine capturing while it
        serves (capture_graphs_in_background) has live requests' keys there. Their marks (kv_reuse.py) vouch
        for nothing meanwhile: a successor must not copy them from an engine killed in between."""
        cache = self.kv[slot]  # [layer, k|v, kv_head, position, head_dim]
        touched = self.position if kind == "decode" else self.prompt_positions
        with self.marks.overwritten(slot, touched) if self.marks is not None else contextlib.nullcontext():
            saved = cache.index_select(3, touched)
            self._compute(kind, slot)
            cache.index_copy_(3, touched, saved)

    def _run(self, kind: str, slot: int) -> torch.Tensor:
        got = self.graphs.get((kind, slot))
        if got is None:
            return self._compute(kind, slot)
        got[0].replay()
        return got[1]

    def _compute(self, kind: str, slot: int) -> torch.Tensor:
        if kind == "decode":
            return self.forward(self.token, self.position, self.kv[slot])
        return self.forward(self.prompt, self.prompt_positions, self.kv[slot], span=self.chunk)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, kv: torch.Tensor,
                span: int | None = None) -> torch.Tensor:
        """Logits ([T, vocab], float32) of `tokens` at `positions` (device tensors of fixed shape), attending
        the cache's first `span` positions (all by default; a first chunk's queries see no further than it)."""
        m = self.model
        span = span or kv.shape[3]
        h = F.embedding(tokens, m.w["tok_embeddings.weight"])
        cos, sin = m.cos.index_select(0, positions), m.sin.index_select(0, positions)
        hidden = self.key_positions[None, :span] > positions[:, None]  # [T, span]: not visible to the query
        return m.layers(h, lambda x, p, i: self._attention(x, p, positions, cos, sin, kv[i], hidden))

    def _attention(self, x: torch.Tensor, p: str, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   cache: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.model.qkv(x, p, cos, sin)
        cache[0].index_copy_(1, positions, k.transpose(0, 1).to(cache.dtype))
        cache[1].index_copy_(1, positions, v.transpose(0, 1).to(cache.dtype))
        span = hidden.shape[1]
        keys, vals = cache[0, :, :span].to(x.dtype), cache[1, :, :span].to(x.dtype)  # [kv_heads, span, hd]
        return self.model.attend(q, keys, vals, hidden, p)
