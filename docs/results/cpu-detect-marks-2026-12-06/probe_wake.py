"""When does a killed process's death mark wake its waiter, against when /proc says it is exiting? 40 owners (each a
process holding 256 MiB with its mark, tests/common/mark_owner.py) SIGKILLed one by one; this process spins on the
owner's /proc/<pid>/stat while a thread waits on the mark. Run: PYTHONPATH=. python probe_wake.py 40 (2026-12-06, the
2-core CPU machine; output in probe_wake.txt)."""
import os, socket, sys, time, signal, threading, subprocess
from libs.common import death_mark as dm
from services.agent.pidfd import proc_exiting, open_stat
OWNER = open('/work/main/tests/common/mark_owner.py').read().split('OWNER = """')[1].split('"""')[0].replace(chr(92)+chr(92)+'1', chr(92)+'1')
res=[]
for i in range(int(sys.argv[1])):
    ours, theirs = socket.socketpair()
    p = subprocess.Popen([sys.executable, "-c", OWNER, str(theirs.fileno())], pass_fds=[theirs.fileno()], env={**os.environ, "PYTHONPATH": "/work/main"})
    theirs.close()
    _, fds, _, _ = socket.recv_fds(ours, 1, 1)
    v = dm.MarkView(fds[0], p.pid); os.close(fds[0])
    sfd = open_stat(p.pid)
    got = {}
    def w():
        while True:
            x = v.wait(1.0)
            if x != v.armed_with: got['m'] = time.time(); return
    t = threading.Thread(target=w); t.start()
    def pollit():
        while True:
            if proc_exiting(p.pid, sfd) is not None: got['p'] = time.time(); return
    time.sleep(0.05)
    k = time.time(); os.kill(p.pid, signal.SIGKILL)
    pollit(); t.join()
    res.append(((got['p']-k)*1000, (got['m']-k)*1000))
    p.wait(); v.close(); os.close(sfd); ours.close()
res.sort(key=lambda r: -r[1])
print("worst by mark (pf_exiting_ms, mark_ms):", [("%.2f"%a, "%.2f"%b) for a,b in res[:8]])
res.sort(key=lambda r: -r[0])
print("worst by pf:", [("%.2f"%a, "%.2f"%b) for a,b in res[:8]])
