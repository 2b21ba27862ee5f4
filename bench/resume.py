"""`holdfast bench resume --size small --generated 1,16,128,512 [--trials 3] [--device auto] [--json]`: what a
request resumed after its engine died costs its successor, with and without the predecessor's KV cache
(engines/reference/kv_reuse.py), side by side in one run.

For each number of tokens generated before the death, a predecessor engine core generates them for a prompt
and stops where it stands (as a SIGKILLed engine leaves its lease: cache and marks intact); then the resumed
request (the prompt plus those tokens, as a router sends it) runs on three successor cores over the same weights:
- recompute: no predecessor's cache: the prompt's chunks and one forward per generated token (exact resume);
- reuse: the predecessor's cache as donor (a promoted shadow's way): the finished prefix copied, one forward;
- in place: the predecessor's cache handed on (a reattach's or cold-spawned takeover's way; each trial on a copy
  of it as the predecessor left it): the request served in the slot that holds its prefix, one forward.
Reported: milliseconds to the resumed request's next token (median of the trials), the ratios, the positions
reused, and whether every way gave the token the uninterrupted generation gave (they must).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import typer

PROMPT = "Holdfast keeps the cache through a crash."
SLOTS = 2


def _cores(size: str, device: str, max_seq: int) -> Iterator[Any]:
    """Engine cores over one set of weights, each with a cache and marks of its own (the first: the donor), or
    with `handed` (a cache and its marks handed on, kept where they hold a request)."""
    import torch

    from engines.reference.config import get_config
    from engines.reference.engine import EngineCore
    from engines.reference.kv_reuse import marks_shape
    from engines.reference.model import Transformer
    from engines.reference.weights import load_weights, make_weights

    cfg = get_config(size)
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       ("cpu" if device == "auto" else device))
    with tempfile.TemporaryDirectory(prefix="holdfast-resume-") as tmp:
        weights = load_weights(make_weights(cfg, Path(tmp) / "w.safetensors", device=dev.type), dev)
    while True:
        kv = torch.zeros(cfg.kv_shape(SLOTS, max_seq), dtype=weights["tok_embeddings.weight"].dtype, device=dev)
        marks = torch.zeros(marks_shape(SLOTS, max_seq), dtype=torch.int64, device=dev)

        def core(donor: Any = None, handed: Any = None, kv: Any = kv, marks: Any = marks) -> EngineCore:
            kv, marks = handed or (kv, marks)
            return EngineCore(Transformer(cfg, weights), kv, marks=marks, donor=donor, graphs=False,
                              inherit=handed is not None)

        yield core


def _first_token_ms(core: Any, context: list[int], prompt_len: int) -> tuple[float, int, float]:
    """(ms to the first token, that token, positions reused) of the resumed request on `core`."""
    import torch

    from engines.reference.engine import GenerationRequest, TokenOut

    phases: dict[str, float] = {}
    core.trace_next(phases, time.perf_counter())
    t0 = time.perf_counter()
    it = core.generate(GenerationRequest(context=context, max_tokens=1, prefix_len=prompt_len, ignore_eos=True))
    ev = next(it)
    if core.model.device.type == "cuda":
        torch.cuda.synchronize(core.model.device)
    ms = (time.perf_counter() - t0) * 1000
    it.close()
    assert isinstance(ev, TokenOut)
    return ms, ev.token, phases.get("kv_reused", 0.0)


def run(size: str, generated: list[int], trials: int = 3, device: str = "auto") -> dict[str, Any]:
    import torch

    from engines.reference.engine import GenerationRequest, TokenOut
    from engines.reference.kv_reuse import KvDonor
    from libs.common import tokenizer

    torch.set_num_threads(1)
    prompt = tokenizer.encode(PROMPT)
    max_seq = len(prompt) + max(generated) + 2
    cores = _cores(size, device, max_seq)
    rows = []
    for k in generated:
        whole = [e.token for e in next(cores)().generate(GenerationRequest(
            context=prompt, max_tokens=k + 1, prefix_len=len(prompt), ignore_eos=True)) if isinstance(e, TokenOut)]
        predecessor = next(cores)()
        stopped = predecessor.generate(GenerationRequest(context=prompt, max_tokens=k + 1, prefix_len=len(prompt),
                                                         ignore_eos=True))
        first = [next(stopped).token for _ in range(k)]  # type: ignore[union-attr]
        context = prompt + first  # what a router resumes with
        assert predecessor.marks is not None
        donor = KvDonor(predecessor.kv, predecessor.marks.marks)
        ways: dict[str, list[tuple[float, int, float]]] = {"recompute": [], "reuse": [], "in_place": []}
        for _ in range(trials):
            ways["recompute"].append(_first_token_ms(next(cores)(), context, len(prompt)))
            ways["reuse"].append(_first_token_ms(next(cores)(donor), context, len(prompt)))
            handed = (predecessor.kv.clone(), predecessor.marks.marks.clone())  # the lease as the death left it
            ways["in_place"].append(_first_token_ms(next(cores)(handed=handed), context, len(prompt)))
        stopped.close()
        med = {w: statistics.median(ms for ms, _, _ in got) for w, got in ways.items()}
        rows.append({
            "generated": k, "context": len(context),
            "recompute_ms": round(med["recompute"], 3), "reuse_ms": round(med["reuse"], 3),
            "ratio": round(med["recompute"] / med["reuse"], 1) if med["reuse"] else None,
            "in_place_ms": round(med["in_place"], 3),
            "in_place_ratio": round(med["recompute"] / med["in_place"], 1) if med["in_place"] else None,
            "positions_reused": ways["reuse"][0][2], "positions_in_place": ways["in_place"][0][2],
            "same_token": all(tok == whole[k] for got in ways.values() for _, tok, _ in got),
        })
    dev = str(next(cores)().model.device)
    return {"size": size, "device": dev, "trials": trials, "prompt_tokens": len(prompt), "rows": rows}


def cli(
    size: str = typer.Option("small", help="model size (engines/reference/config.py)"),
    generated: str = typer.Option("1,16,128,512", help="tokens generated before the death, comma-separated"),
    trials: int = typer.Option(3, min=1),
    device: str = typer.Option("auto", help="auto, cpu, cuda"),
    as_json: bool = typer.Option(False, "--json", help="print the result as JSON"),
) -> None:
    """A resumed request's next token after its engine died: recomputed vs from the predecessor's KV cache (copied,
    or in place)."""
    out = run(size, [int(x) for x in generated.split(",") if x.strip()], trials, device)
    if as_json:
        print(json.dumps(out))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"resume after a death: {out['size']} on {out['device']}, {out['trials']} trials")
    for col in ("generated", "recompute ms", "reuse ms", "ratio", "in place ms", "ratio", "reused", "same token"):
        table.add_column(col, justify="right")
    for r in out["rows"]:
        table.add_row(str(r["generated"]), f"{r['recompute_ms']:.1f}", f"{r['reuse_ms']:.1f}", f"{r['ratio']}x",
                      f"{r['in_place_ms']:.1f}", f"{r['in_place_ratio']}x", str(int(r["positions_reused"])),
                      str(r["same_token"]))
    Console().print(table)
