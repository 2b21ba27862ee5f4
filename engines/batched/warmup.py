"""A standby's warm-up before it holds any lease: the runner's kernels on a scratch one-layer model, so that its
first step after a takeover compiles and loads nothing. Used by a single standby (__main__.py) and by every rank
of a standby group (tp_group.py); a module of its own so neither imports the other."""

from __future__ import annotations

import time

import torch

from engines.batched.cache_units import kv_shape
from engines.batched.config import EngineConfig
from engines.batched.model_runner import ModelRunner, RunItem
from engines.reference.config import ModelConfig
from libs.common.procs import ms_since
from libs.common.tokenizer import BOS


def warm_kernels(mcfg: ModelConfig, cfg: EngineConfig, device: torch.device) -> float:
    """A standby's warm-up: the runner's kernels on a scratch one-layer model (no lease), so its first step
    after a takeover compiles and loads nothing."""
    t0 = time.perf_counter()
    # a rank of an uneven group: two layers, whose heads differ (tp.py), so a layer of several cache units is warm too
    small = mcfg.with_layers(1 if len({mcfg.kv_heads_at(i) for i in range(mcfg.n_layers)}) == 1 else 2)
    dtype = torch.float32 if mcfg.dtype == "float32" else torch.bfloat16
    w = {n: torch.empty(s, device=device, dtype=dtype).normal_(0.0, 0.02) for n, s in small.tensor_shapes().items()}
    kv = torch.zeros(kv_shape(small, 8, cfg.block_size), dtype=dtype, device=device)
    runner = ModelRunner(small, w, kv, cfg.block_size, deterministic=cfg.deterministic, cuda_graphs=False,
                         max_num_seqs=4, deterministic_tile=cfg.deterministic_tile)
    runner.run([RunItem(token_ids=[BOS, 1, 2], start=0, block_table=[0], sample=True, temperature=0.0, seed=0),
                RunItem(token_ids=[BOS], start=0, block_table=[1], sample=True, temperature=0.7, seed=1)])
    runner.run([RunItem(token_ids=[3], start=3, block_table=[0], sample=True, temperature=0.0, seed=0)])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return ms_since(t0)
