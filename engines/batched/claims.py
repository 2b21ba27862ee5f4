"""Recovery's side of the step loop: sequences adopted from a predecessor's journal, and the resumed requests
that claim them (journal.py has the journal; engine.py calls these between steps, on the step thread).

A successor handed the KV lease adopts every sequence the journal committed and runs them at once, with no
prefill (their KV is there). Until a resumed request claims it, an adopted sequence's tokens wait in its buffer;
the claim matches the request id the router sends (or, failing that, the tokens), and reconciles the two views of
the sequence: tokens the client saw past the journal are taken as given, and tokens the engine made past what the
client saw are sent first. An adopted sequence nobody claims within `adopt_claim_s` is dropped and its blocks
freed.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable

from engines.batched.journal import Entry
from engines.batched.live import Counters, Live, LiveSet, Request, finish_reason, request_params
from engines.batched.scheduler import Scheduler
from engines.batched.sequence import SeqStatus, Sequence

# Tokens an unclaimed adopted sequence makes ahead of its claim. Its claim sends them at once (the client's
# first token after a failover costs no step); past them, while every live sequence is unclaimed, the step
# thread waits for claims instead of running on: the router's replay burst is taken off the HTTP front's link by a
# thread (front_link.py) that shares the interpreter with the step thread.
ADOPTED_AHEAD = 4
# While adopted sequences wait for their claims, the interpreter switches threads every 0.5 ms, not 5 ms: the
# front-link thread taking the replay burst (80 requests at 64 + 16 streams) gets its turns while the step thread runs
# Python (a graph capture, a step). Only then: serving 256 streams, the shorter interval cost the step thread
# more than it gave (H200, 8b: ITL p50 33 ms against 25 ms).
CLAIM_SWITCH_INTERVAL_S = 0.0005
# After a takeover no new request is admitted (no prefill chunk joins a step) until every claimed adopted
# sequence has sent its first token after its claim, or this long after the adoption: the first steps are pure
# decode (the captured graph, ~7 ms at 8b x 64), not mixed steps with the late prompts' prefill (the
# no-failure control's largest gap, ~160 ms at 64 + 16 on the H200, was that prefill). Admission order and
# prefill chunks are unchanged, so deterministic outputs are too.
RESUME_FIRST_S = 0.5


class Claims:
    """Adoption, claims and expiry over the engine's `LiveSet`. The interpreter's switch interval is shortened
    from the first adoption until every adopted sequence is claimed or expired, then restored."""

    def __init__(self, table: LiveSet, counters: Counters, adopt_claim_s: float) -> None:
        self.table, self.counters = table, counters
        self.adopt_claim_s = adopt_claim_s
        self._switch_interval: float | None = None  # the interpreter's, while a recovery's claims are awaited

    def adopt(self, scheduler: Scheduler, entries: list[Entry], dropped: int, hold: Iterable[int] = ()) -> None:
        """Sequences a predecessor committed to the journal: running again at once (before the loop starts)."""
        now = time.perf_counter()
        seqs: list[Sequence] = []
        for e in entries:
            params = request_params(e.max_tokens, e.temperature, e.seed, e.ignore_eos)
            seq = Sequence(seq_id=self.table.next_id(), request_id=e.request_id, tokens=list(e.tokens),
                           prompt_len=e.prompt_len, params=params)
            seq.num_computed = e.computed
            seq.block_table = list(e.block_table)
            seqs.append(seq)
            live = Live(seq, None, e.slot, sent=len(e.tokens) - e.prompt_len, adopted_at=now, adopted_len=len(e.tokens))
            self.table.live[seq.seq_id] = live
            self.table.orphans[seq.seq_id] = live
        scheduler.adopt(seqs, hold)
        self.table.resuming = {seq.seq_id for seq in seqs}
        self.table.resume_until = now + RESUME_FIRST_S
        if seqs and self._switch_interval is None:
            self._switch_interval = sys.getswitchinterval()
            sys.setswitchinterval(CLAIM_SWITCH_INTERVAL_S)
        self.counters.adopted += len(seqs)
        self.counters.journal_dropped += dropped

    def claim(self, req: Request) -> Live | None:
        """An adopted sequence this resumed request continues, reconciled with what the client saw."""
        orphans = self.table.orphans
        if not orphans:
            return None
        sid = self.table.by_request.get(req.request_id) if req.request_id else None
        live = orphans.get(sid) if sid is not None else None
        if live is None:  # no id (an older router): the same tokens and sampling
            live = next((o for o in orphans.values() if _prefix_related(o.seq.tokens, req.context)
                         and o.seq.params.seed == req.seed and o.seq.params.temperature == req.temperature), None)
        if live is None or len(req.context) < live.seq.prompt_len or not _prefix_related(live.seq.tokens, req.context):
            return None
        seq = live.seq
        self.counters.claim_past_adopted_tokens += max(0, len(req.context) - live.adopted_len)
        extra = req.context[len(seq.tokens):]
        if extra and seq.status == SeqStatus.FINISHED:
            return None  # the client saw more than this sequence ever made: not the same generation
        if extra:  # the client saw tokens the journal had not committed: they are the sequence's, as given
            if live.slot is not None:  # and its row's, before a commit's progress covers them (a later successor)
                self.table.journal.write_tokens(live.slot, len(seq.tokens), extra)
            seq.tokens.extend(extra)
            self.counters.claim_extra_tokens += len(extra)
        del orphans[seq.seq_id]
        live.sink, live.req = req.sink, req
        # the client has everything up to its context; send what the engine made past it
        live.sent = len(req.context) - seq.prompt_len
        if len(seq.tokens) > len(req.context):
            req.t_first_token = time.perf_counter()
        for tok in seq.tokens[len(req.context):]:
            req.sink.token(tok)
            live.sent += 1
            self.table.resuming.discard(seq.seq_id)
        self.table.by_request[req.request_id] = seq.seq_id
        if seq.status == SeqStatus.FINISHED:  # it ended while unclaimed: its tokens are all there
            req.sink.finish(finish_reason(seq), seq.prompt_len, len(seq.tokens) - seq.prompt_len)
            self.counters.requests_done += 1
            self.table.leave(live)
        return live

    def expire(self, scheduler: Scheduler) -> None:
        """Drop adopted sequences unclaimed past `adopt_claim_s`; once none waits, restore the switch interval."""
        now = time.perf_counter()
        orphans = self.table.orphans
        for live in [o for o in orphans.values() if now - o.adopted_at > self.adopt_claim_s]:
            del orphans[live.seq.seq_id]
            if live.seq.status != SeqStatus.FINISHED:
                scheduler.abort(live.seq.seq_id)
            self.table.leave(live)
            self.counters.adopted_dropped += 1
        if not orphans and self._switch_interval is not None:  # every claim in (or expired)
            sys.setswitchinterval(self._switch_interval)
            self._switch_interval = None

    def ahead(self) -> bool:
        """Every live sequence is adopted and unclaimed, and each has its ADOPTED_AHEAD tokens (or has ended):
        no step is needed until a claim or a new request comes."""
        orphans = self.table.orphans
        if not orphans or len(orphans) != len(self.table.live):
            return False
        return all(o.seq.status == SeqStatus.FINISHED or len(o.seq.tokens) - o.adopted_len >= ADOPTED_AHEAD
                   for o in orphans.values())


def _prefix_related(a: list[int], b: list[int]) -> bool:
    n = min(len(a), len(b))
    return a[:n] == b[:n]
