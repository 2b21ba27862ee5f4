"""Encode and decode costs of the hot events, this tree's codec (run from a worktree's root)."""
import sys, os, time, timeit
sys.path.insert(0, os.getcwd())
from libs.common.events import *
from libs.common.bus import codec
TP = "00-ed3b4f17d307403ec11649204e407cbd-03cd229149ecfa26-01"
INC = "inc-n0000-g0-e0-g0"
f = FaultDetected(engine_id='n0000-g0-e0', kind='killed', node='n0000', died_at=1796281331.6365201, signal=9, model='m', engine_class='sim')
r = IntentResult(incident_id=INC, step="reattach", ok=True, detail="standby", successor_id="n0000-g0-e0-s1",
                 endpoint="http://127.0.0.1:9/n0000-g0-e0-s1", timings_ms={"attach": 0.0, "reattach": 28.927, "freeze": 23.226},
                 frozen_at=1796281331.7352383)
rec = RecoverIntent(incident_id=INC, engine_id="n0000-g0-e0", model="m", engine_class="sim", kind="killed", node="n0000")
n = 20000
def t(fn): return min(timeit.repeat(fn, number=n, repeat=5)) / n * 1e6
out = []
for p, tp, inc in ((f, None, None), (rec, TP, INC), (r, TP, INC)):
    enc = lambda: codec.event_body(p, id=INC + "-x", source="controller:c1", node="n0000", incident_id=inc, traceparent=tp, tracestate=None)
    body = enc()
    out.append(f"{type(p).__name__}: {len(body)} B, encode {t(enc):.2f} us, decode {t(lambda: decode_event(body)):.2f} us")
print("\n".join(out))
