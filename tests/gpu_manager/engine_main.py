"""A test engine on the SDK, driven by one command a line on stdin, one JSON reply a line on stdout.

    write N SEED [TAG [GPU]]  allocate N bytes (on GPU, default 0), fill with a seeded pattern, register, commit
    backup N SEED GPU RANK SIZE   the same as a host lease named as rank RANK of SIZE's KV backup (tensor of that name)
    hash                    sha256 of every registered tensor as this process sees it now
    pending                 lease ids waiting for this engine id
    attach                  attach own leases back; reply their ids, epochs and the tensors' hashes
    takeover PRED TOKEN     take over a frozen predecessor's leases
    takeover_fenced PRED TOKEN   the same, fenced (granted once the predecessor is stopped; `fence`: whom to await)
    gang_takeover GANG RANK SUCC1,SUCC2.. GENERATION TOKEN [degraded]   rank RANK of a successor group takes its
                            gang's leases (degraded: a smaller group takes a broken gang's KV backups)
    share OWNER TOKEN       map an owner's weight leases read-only (a standby's shadow)
    poke                    write one byte into the first tensor (a shadow: the process should fault)
    reconnect               new connection to the manager (e.g. after it restarted), keep mappings
    heartbeats SECONDS      start the SDK's heartbeat thread (it also reconnects by itself)
    status                  connected?, reconnects, held and lost leases with epochs, mapping addresses
    call OP JSON            send a raw request (for refusal tests); reply the error code or "ok"
    sleep IDS / wake IDS    release / renew leases' physical memory, addresses kept; reply bytes, source, ptrs
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import traceback

import numpy as np

from libs.client import protocol as p
from libs.client.memory import Attachment, MemoryClient
from libs.common.errors import HoldfastError


class TestEngine:
    def __init__(self, engine_id: str, backend: str) -> None:
        self.engine_id = engine_id
        self.framework = "torch" if backend == "cuda" else "numpy"
        self.client = MemoryClient.connect(engine_id)
        self.views: dict = {}

    def _bytes(self, view) -> bytes:  # noqa: ANN001
        if self.framework == "torch":
            return view.contiguous().view(-1).cpu().numpy().tobytes()
        return np.ascontiguousarray(view).tobytes()

    def hashes(self) -> dict[str, str]:
        return {k: hashlib.sha256(self._bytes(v)).hexdigest() for k, v in self.views.items()}

    def write(self, n: int, seed: int, tag: str | None = None, gpu: int = 0, name: str | None = None,
              host: bool = False) -> dict:
        """A lease of `n` bytes of a seeded pattern, registered as tensor "data" (or, given a tag or a name, as a
        tensor named after it, beside the earlier ones), committed."""
        name = name or tag or "data"
        lease = self.client.allocate(n, name=name, gpu=gpu, host=host, **({"tag": tag} if tag else {}))
        pattern = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
        if self.framework == "torch":
            import torch

            view = lease.torch("uint8", (n,))
            view.copy_(torch.from_numpy(pattern).to(view.device))
            torch.cuda.synchronize()
        else:
            view = lease.numpy("uint8", (n,))
            view[:] = pattern
        self.client.register([lease.meta(name, "uint8", (n,))])
        digest = self.client.commit()
        self.views = {**self.views, name: view} if name != "data" else {"data": view}
        return {"lease": lease.id, "epoch": lease.epoch, "layout": digest, "expected": hashlib.sha256(pattern.tobytes()).hexdigest(),
                **self.hashes()}

    def grant(self, att: Attachment, *, fenced: bool = False) -> dict:
        self.views = att.tensors(self.framework)
        out = {"leases": {lease.id: lease.epoch for lease in att.leases}, "layout": att.layout_hash, **self.hashes()}
        if not fenced:
            return out
        return {**out, "fence": [f.pid for f in att.fence], "manager_ms": self.client.last_timings_ms.get("manager_ms")}

    def handle(self, words: list[str]) -> dict:
        cmd = words[0]
        if cmd == "write":
            return self.write(int(words[1]), int(words[2]), *words[3:4], *(int(w) for w in words[4:5]))
        if cmd == "backup":
            n, seed, gpu, rank, size = (int(w) for w in words[1:6])
            return self.write(n, seed, "other", gpu, name=f"kv_backup.tp{size}-r{rank}", host=True)
        if cmd == "hash":
            return self.hashes()
        if cmd == "pending":
            return {"pending": [i.id for i in self.client.pending()]}
        if cmd == "attach":
            return self.grant(self.client.attach())
        if cmd == "takeover":
            return self.grant(self.client.takeover(words[1], words[2]))
        if cmd == "takeover_fenced":
            return self.grant(self.client.takeover(words[1], words[2], fenced=True), fenced=True)
        if cmd == "gang_takeover":
            att = self.client.gang_takeover(words[1], int(words[2]), words[3].split(","), int(words[4]), words[5],
                                            degraded=words[6:7] == ["degraded"])
            gang = self.client.last_gang
            return {**self.grant(att), "gang": gang.model_dump(mode="json") if gang is not None else None}
        if cmd == "share":
            att = self.client.share(words[1], words[2])
            out = self.grant(att)
            out["read_only"] = {lease.id: lease.mapping.read_only for lease in att.leases}
            out["ptrs"] = {lease.id: lease.ptr for lease in att.leases}
            return out
        if cmd == "poke":
            view = next(iter(self.views.values()))
            view[0] = (int(view[0]) + 1) % 256
            if self.framework == "torch":
                import torch

                torch.cuda.synchronize()  # a fault on the GPU surfaces here
            return {"ok": True}
        if cmd == "reconnect":
            old = self.client
            self.client = MemoryClient.connect(self.engine_id)
            self.client.leases = old.leases
            old.close(unmap=False)
            return {"ok": True}
        if cmd == "heartbeats":
            self.client.start_heartbeats(float(words[1]))
            return {"ok": True}
        if cmd == "status":
            c = self.client
            return {"connected": c.connected, "reconnects": c.reconnects, "lost": c.lost_leases,
                    "leases": {i: lease.epoch for i, lease in c.leases.items()},
                    "ptrs": {i: lease.ptr for i, lease in c.leases.items()}, "manager_pid": c.hello.manager_pid,
                    "shared": {i: lease.ptr for i, lease in c.shared.items()}}
        if cmd == "sleep":
            return {"ok": True, "bytes": self.client.sleep(words[1:]).bytes}
        if cmd == "wake":
            source = self.client.wake(words[1:])
            return {"ok": True, "source": source, "ptrs": {i: self.client.leases[i].ptr for i in words[1:]},
                    **self.hashes()}
        if cmd == "call":
            req = p.parse_request({"op": words[1], **json.loads(" ".join(words[2:]) or "{}")})
            self.client._call(req)
            return {"code": "ok"}
        raise ValueError(cmd)


def main() -> None:
    # SDK logs go to stderr, where a test may count them (one warning per outage, one info when back)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    engine = TestEngine(sys.argv[1], sys.argv[2])
    for line in sys.stdin:
        try:
            out = engine.handle(line.split())
        except HoldfastError as e:
            out = {"code": e.code, "message": e.message}
        except Exception as e:  # noqa: BLE001 - report to the test, keep the engine alive
            out = {"code": "exception", "message": f"{e!r}", "trace": traceback.format_exc()}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
