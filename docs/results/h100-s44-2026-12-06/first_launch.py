"""A bare tiny-model runner's first launches on a GPU: ms of wall and of the calling thread's CPU for runner.launch of
8 decode rows (then 8 fed from it), the tokens read back after each. `python3 first_launch.py [base|warm|prof]`:
warm first runs the kernels a launch runs beside its graph (what model_runner.py `_warm_launch` now does itself);
prof prints a cProfile of the first two launches."""
import cProfile, pstats, io, os, threading, time, random, torch, sys
sys.path.insert(0, ".")
from engines.batched.model_runner import ModelRunner, RunItem, Launched
from engines.reference.weights import load_weights, make_weights
from tests.engine_batched.test_model_runner import BLOCKS, BS, CFG, random_prompt, random_tables
from pathlib import Path
mode = sys.argv[1] if len(sys.argv) > 1 else "base"
w = {n: t.cuda() for n, t in load_weights(make_weights(CFG, Path("/tmp/tw.safetensors"), seed=3)).items()}
kv = torch.zeros(CFG.n_layers, 2, BLOCKS, BS, CFG.n_kv_heads, CFG.head_dim, device="cuda")
r = ModelRunner(CFG, w, kv, BS, max_num_seqs=32, max_step_tokens=512)
t = time.perf_counter(); r.warmup(); print(mode, os.environ.get("CUDA_MODULE_LOADING"), "warmup ms %.0f" % ((time.perf_counter() - t) * 1000))
if mode == "warm":
    t = time.perf_counter()
    with torch.inference_mode():
        for b, (g, logits) in r._graphs.items():
            Launched(torch.argmax(logits[:b], dim=-1), []).tokens()
            logits[[0]].cpu()
        fed = torch.zeros(2, dtype=torch.int64, device="cuda"); at = torch.zeros(1, dtype=torch.int64, device="cuda")
        fed.index_copy_(0, at, fed.index_select(0, at))
        torch.cuda.synchronize()
    print("extra warm ms %.1f" % ((time.perf_counter() - t) * 1000))
rng = random.Random(0)
tables = random_tables(rng, [40] * 8)
items = [RunItem([5], 20, tb, True) for tb in tables]
fitems = [RunItem([5], 21, tb, True, feed=i) for i, tb in enumerate(tables)]
def step(label, its, prev=None, prof=False):
    pr = cProfile.Profile() if prof else None
    t0, c0 = time.perf_counter(), time.thread_time()
    if pr: pr.enable()
    with torch.inference_mode():
        l = r.launch(its, prev)
    if pr: pr.disable()
    t1, c1 = time.perf_counter(), time.thread_time()
    l.tokens()
    print(label, "launch ms %.2f cpu %.2f" % ((t1 - t0) * 1000, (c1 - c0) * 1000))
    if pr:
        s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14); print(s.getvalue())
    return l
a = step("main 1", items, prof=mode == "prof")
b = step("main 2 fed", fitems, a, prof=mode == "prof")
step("main 3 fed", fitems, b)
def th():
    x = step("thread 1", items); step("thread 2 fed", fitems, x)
x = threading.Thread(target=th); x.start(); x.join()
