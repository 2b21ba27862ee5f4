import json, sys, torch
from functools import partial
sys.path.insert(0, '.')
from scripts.bench_paged_attention import timed, BS
from engines.batched.memory import _fuse_local
from engines.batched.model_runner import ModelRunner, RunItem
from engines.reference.config import get_config
cfg = get_config('8b@8'); ctx = 512; batches = [1, 16, 64, 128, 256]
weights = {n: torch.randn(s, device="cuda", dtype=torch.bfloat16) * 0.02 for n, s in cfg.tensor_shapes().items()}
nb = -(-ctx // BS) + 1
kv = torch.zeros(cfg.n_layers, 2, max(batches) * nb, BS, cfg.n_kv_heads, cfg.head_dim, device="cuda", dtype=torch.bfloat16)
fused = _fuse_local(weights)
out = {}
for name, det, tile in (("default", False, None), ("det64", True, None), ("det128", True, 128), ("det256", True, 256)):
    r = ModelRunner(cfg, weights, kv, BS, deterministic=det, cuda_graphs=True, max_num_seqs=256, fused=fused,
                    deterministic_tile=tile, max_step_tokens=512)
    r.warmup()
    out[name] = {b: round(timed(partial(r.run, [RunItem([1], ctx - 1, list(range(i * nb, (i + 1) * nb)), True) for i in range(b)]), 10), 3) for b in batches}
    print(name, out[name], flush=True)
    r = None; torch.cuda.empty_cache()
json.dump(out, open(sys.argv[1], 'w'))
