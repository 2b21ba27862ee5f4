"""`python -m engines.reference make-weights --size tiny --out w.safetensors [--seed 0] [--dtype float32] [--drawn]`
`python -m engines.reference serve --weights w.safetensors [--size tiny] [--port 0] ...` (see settings.py)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from engines.reference.config import SIZES, get_config


def make_weights_cmd(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="holdfast engine make-weights", description="write a seeded weights file")
    p.add_argument("--size", default="tiny", help=f"{', '.join(SIZES)}, or <size>@<layers>")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--seed", default=0, type=int)
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: the size's)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="where the values are drawn (auto: cuda when torch sees a GPU; much faster for large files)")
    p.add_argument("--drawn", action="store_true",
                   help="write the header alone: a load draws the values on its own device (weights larger than "
                        "the disk or RAM; the batched engine and single reference engines load it)")
    a = p.parse_args(argv)
    from engines.reference.weights import make_weights

    try:
        cfg = get_config(a.size)
    except ValueError as e:
        p.error(str(e))
    device = a.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    out = make_weights(cfg, a.out, seed=a.seed, dtype=a.dtype, device=device, drawn=a.drawn)
    print(json.dumps({"out": str(out), "size": cfg.name, "params": cfg.n_params(), "bytes": out.stat().st_size}))
    return 0


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if argv else 2)
    cmd, rest = argv[0], argv[1:]
    if cmd == "make-weights":
        sys.exit(make_weights_cmd(rest))
    if cmd == "serve":
        from engines.reference.runner import run
        from engines.reference.settings import parse_engine_settings

        sys.exit(run(parse_engine_settings(rest)))
    print(f"unknown command {cmd!r}\n{__doc__}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    main(sys.argv[1:])
