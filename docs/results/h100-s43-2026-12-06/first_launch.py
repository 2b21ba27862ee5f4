import threading, time, random, torch, sys
sys.path.insert(0, ".")
from engines.batched.model_runner import ModelRunner, RunItem
from engines.reference.weights import load_weights, make_weights
from tests.engine_batched.test_model_runner import BLOCKS, BS, CFG, random_prompt, random_tables
from pathlib import Path
w = {n: t.cuda() for n, t in load_weights(make_weights(CFG, Path("/tmp/tw.safetensors"), seed=3)).items()}
kv = torch.zeros(CFG.n_layers, 2, BLOCKS, BS, CFG.n_kv_heads, CFG.head_dim, device="cuda")
r = ModelRunner(CFG, w, kv, BS, max_num_seqs=32, max_step_tokens=512)
t = time.perf_counter(); r.warmup(); print("warmup ms", (time.perf_counter() - t) * 1000)
rng = random.Random(0)
tables = random_tables(rng, [40] * 8)
items = [RunItem([5], 20, tb, True) for tb in tables]
def step(label):
    t0, c0 = time.perf_counter(), time.thread_time()
    with torch.inference_mode():
        l = r.launch(items)
    t1, c1 = time.perf_counter(), time.thread_time()
    l.tokens()
    print(label, "launch ms %.2f cpu %.2f" % ((t1 - t0) * 1000, (c1 - c0) * 1000))
step("main 1"); step("main 2")
def th():
    step("thread A 1"); step("thread A 2"); step("thread A 3")
x = threading.Thread(target=th); x.start(); x.join()
x = threading.Thread(target=th); x.start(); x.join()
