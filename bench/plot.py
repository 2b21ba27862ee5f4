"""`python -m bench.plot`: recovery time vs weights size for the three ways, from the recovery benchmark's
JSON results in docs/results/ (files named `*recovery*.json`), drawn to docs/recovery.png. Where several files
measured the same way at the same size, the newest (`measured_at`, else none: older) is drawn."""

from __future__ import annotations

import json
import sys
from pathlib import Path

WAYS = {"cold_restart": "cold restart", "fresh_process_reattach": "fresh-process reattach",
        "warm_standby_unshadowed": "warm standby, attaching at the takeover",
        "warm_standby": "warm standby takeover (shadowing)"}


def load(results: Path) -> list[dict]:
    out = []
    for path in sorted(results.glob("*recovery*.json")):
        doc = json.loads(path.read_text())
        doc["_file"] = path.name
        out.append(doc)
    return out


def gib_of(doc: dict) -> float:
    """The measured weights size: the requested one, or the named model's."""
    if doc.get("weights_gib"):
        return float(doc["weights_gib"])
    from engines.reference.config import get_config

    cfg = get_config(doc["size"])
    return cfg.n_params() * cfg.bytes_per_param() / 2**30


def main(argv: list[str] | None = None) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    root = Path(__file__).resolve().parents[1] / "docs"
    docs = load(root / "results")
    if not docs:
        print("no recovery results in docs/results", file=sys.stderr)
        return 1
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for backend, marker in (("cuda", "o"), ("host", "s")):
        for way, label in WAYS.items():
            newest: dict[float, tuple[str, float]] = {}
            for d in docs:
                if d["backend"] == backend and (d.get(way) or {}).get("death_to_first_token_ms"):
                    at, gib = d.get("measured_at", ""), round(gib_of(d), 2)
                    if gib not in newest or at >= newest[gib][0]:
                        newest[gib] = (at, d[way]["death_to_first_token_ms"]["p50"])
            pts = sorted((gib, p50) for gib, (_, p50) in newest.items())
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.plot(xs, ys, marker=marker, label=f"{label} ({'H200' if backend == 'cuda' else 'CPU, host backend'})")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("weights (GiB)")
    ax.set_ylabel("death -> first token, p50 (ms)")
    ax.set_title("Serving again after a SIGKILL")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    out = root / "recovery.png"
    fig.savefig(out, dpi=120)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
