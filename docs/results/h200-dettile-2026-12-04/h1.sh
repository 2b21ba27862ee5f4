#!/usr/bin/env bash
# device call 1 (s28): rows_mm (deterministic one-token rows in one batch-invariant launch) and the shared norm
# helper: gpu tests; the runner's decode step, default vs deterministic, this tree vs HEAD's engines; rows_mm alone
set -u
OUT=${OUT:-/tmp/out}; mkdir -p /tmp/hfw/s
mkdir -p .device && tar xzf .devpack/device-bin.tgz -C .device && chmod +x .device/bin/*
NOW=/tmp/site:$PWD/.devtree/now; PREV=/tmp/site:$PWD/.devtree/prev; ROOT=$PWD
cd .devtree/now
PYTHONPATH=$NOW timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine_batched/test_rows_mm_gpu.py \
  tests/engine_batched/test_model_runner_gpu.py tests/engine_batched/test_fused_gpu.py 2>&1 | tail -15 | tee $OUT/gpu_tests.log
PYTHONPATH=$NOW timeout 120 python3 - <<'PY' 2>&1 | tee $OUT/rows_mm.txt
import torch, torch.nn.functional as F
from engines.batched import paged_kernels as pk
def t(fn, r=30):
    for _ in range(3): fn()
    ts=[]
    for _ in range(r):
        a,b=torch.cuda.Event(enable_timing=True),torch.cuda.Event(enable_timing=True); a.record(); fn(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
    ts.sort(); return ts[len(ts)//2]
for n,k in [(6144,4096),(4096,4096),(28672,4096),(4096,14336),(128256,4096)]:
    w=torch.randn(n,k,device='cuda',dtype=torch.bfloat16)
    gb=n*k*2/1e9
    for m in (1,64,256):
        x=torch.randn(m,k,device='cuda',dtype=torch.bfloat16)
        a=t(lambda: pk.rows_mm(x,w)); b=t(lambda: F.linear(x,w))
        print(f"n={n} k={k} m={m}: rows_mm {a:.3f} ms ({gb/a*1e3:.0f} GB/s)  cublas {b:.3f} ms ({gb/b*1e3:.0f} GB/s)")
PY
for tree in now prev now; do
  if [ $tree = now ]; then PP=$NOW; else PP=$PREV; fi
  PYTHONPATH=$PP timeout 200 python3 $ROOT/.devtree/$tree/scripts/bench_paged_attention.py --size 8b@8 --batches 1,16,64,128,256 --ctx 512 \
    --skip-decode > $OUT/bench-$tree-$RANDOM.json 2>/tmp/b.err; echo "bench $tree rc=$?"; tail -2 /tmp/b.err
done
ls $OUT
