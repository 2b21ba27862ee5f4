"""Which read of one 16 GiB safetensors file is fastest on this disk: fastsafetensors vs our O_DIRECT block reads
(several depths) vs buffered reads; each read after POSIX_FADV_DONTNEED. Prints one JSON line per read."""
import json, mmap, os, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
import torch
from safetensors.torch import save_file

path = sys.argv[1]
GIB = 1 << 30
if not os.path.exists(path):
    t0 = time.perf_counter()
    ts = {f"t{i}": torch.randint(-30000, 30000, (GIB // 2,), dtype=torch.int16, device="cuda").cpu() for i in range(16)}
    save_file(ts, path)
    del ts
    os.sync()
    print(json.dumps({"written_s": round(time.perf_counter() - t0, 1)}), flush=True)
size = os.path.getsize(path)

def drop():
    fd = os.open(path, os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)

def reads(workers, block, direct):
    drop()
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    local = threading.local()
    end = size - size % 4096 if direct else size
    def rd(off):
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = mmap.mmap(-1, block)
        n = min(block, end - off)
        if direct:
            n = -(-n // 4096) * 4096
        got = os.preadv(fd, [memoryview(buf)[:n]], off)
        return got
    t0 = time.perf_counter()
    with ThreadPoolExecutor(workers) as ex:
        total = sum(ex.map(rd, range(0, end, block)))
    s = time.perf_counter() - t0
    os.close(fd)
    return {"read": f"{'direct' if direct else 'buffered'} {workers}x{block >> 20}MiB", "gib_s": round(total / GIB / s, 3), "s": round(s, 2)}

def fst():
    from fastsafetensors import SafeTensorsFileLoader, SingleGroup
    drop()
    t0 = time.perf_counter()
    loader = SafeTensorsFileLoader(SingleGroup(), "cuda:0", nogds=True)
    loader.add_filenames({0: [path]})
    fb = loader.copy_files_to_device()
    torch.cuda.synchronize()
    s = time.perf_counter() - t0
    fb.close(); loader.close()
    return {"read": "fastsafetensors nogds", "gib_s": round(size / GIB / s, 3), "s": round(s, 2)}

for f in [fst, lambda: reads(16, 64 << 20, True), lambda: reads(64, 8 << 20, True), lambda: reads(16, 64 << 20, False),
          lambda: reads(32, 16 << 20, False), fst]:
    print(json.dumps(f()), flush=True)
