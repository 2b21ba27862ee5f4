import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as e:
    print(sys.argv[2], "no report", e); sys.exit()
s = d["sigkill"]
rec = s["successor"]["recovery"]
print(sys.argv[2], "secure", d.get("secure"), "gap", s.get("largest_gap_ms"), "late_first", s.get("late_first_token_ms"),
      "resumed", s.get("stream_resumed_after_kill_ms"), "lost", s.get("lost"),
      "recomputed", s.get("successor", {}).get("recomputed_prefill_tokens"), "control gap", d["no_failure"].get("largest_gap_ms"))
for t, r in zip(s["timeline_ms"], rec):
    m = r.get("memory_ms", {})
    print("  ", {k: v for k, v in t.items() if "step" in k})
    print("  assigned %.1f ready %.1f first_token %.1f frozen %.1f | ready_ms %s | req %s map %s views %s fused %s kv %s | adopt %s fence %s" % (
        t.get("successor assigned", -1), t.get("successor ready", -1), t.get("first token after recovery", -1), t.get("frozen", -1),
        r.get("ready_ms"), m.get("request_ms"), m.get("map_ms"), m.get("views_ms"), m.get("fused_ms"),
        m.get("leases", {}).get("kv_cache:kv_cache"), r.get("adopt_ms"), r.get("fence")), "manager", m.get("manager_ms"))
    print("  at_ms", r.get("at_ms"), "mark", r.get("drain_mark_ms"), r.get("drain_mark_split_ms"))
    print("  timeline", " ".join(f"{k.replace(' ', '_')}={v}" for k, v in t.items()))
succ = s["successor"]
for k, st in enumerate(succ.get("step_times", [])):
    sl = {x["at_step"]: x["ms"] for x in st.get("slowest", [])}
    print("  kill %d: step1 %s step2 %s step3 %s | apply %s" % (k, sl.get(1), sl.get(2), sl.get(3),
          (rec[k].get("adopt_ms") or {}).get("apply") if k < len(rec) else None))
    for f in st.get("first") or []:
        print("     first", f)
print("  standby_gpu_mib", [sorted(x.values()) if x else x for x in s.get("standby_gpu_mib") or []])
