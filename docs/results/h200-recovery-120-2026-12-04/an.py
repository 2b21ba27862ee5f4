import json, sys
for f in sys.argv[1:]:
    d = json.load(open(f))
    print("==", f)
    for k in ("no_failure", "sigkill"):
        x = d[k]
        print(k, "gap", x["largest_gap_ms"], "\n  late", x["late_first_token_ms"], "\n  resumed", x["stream_resumed_after_kill_ms"],
              "lost", x["lost"], x.get("wrong_length"), "mism", x["mismatched"], "req", x["requests"])
    s = d["sigkill"]["successor"]
    print("recomputed", s["recomputed_prefill_tokens"], "adopted", s["adopted"], "claimed", s["claimed"])
    rll = d["sigkill"].get("router_loop_late") or []
    for i, (t, r) in enumerate(zip(d["sigkill"]["timeline_ms"], s["recovery"])):
        print(" T%d" % i, {k: v for k, v in t.items()})
        print("    ", {k: r.get(k) for k in ("ready_ms", "first_arrival_ms", "first_held_ms", "first_request_ms")},
              "mem", r["memory_ms"], "fence", r.get("fence"), "adopt", r.get("adopt_ms"))
        if i < len(rll):
            print("     router loop", rll[i])
    for ph in s["first_token_phases_ms"]:
        print("  phases", ph)
