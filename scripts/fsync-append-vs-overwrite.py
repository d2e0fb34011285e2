#!/usr/bin/env python3
"""Append + fdatasync vs overwrite + fdatasync on this disk, interleaved A/B so both see the same
noise (the development VM's fdatasync latency moves several-fold within seconds).

Usage: scripts/fsync-append-vs-overwrite.py [ITERATIONS] [DIR]   (DIR defaults to target/)
"""
import os, sys, time, statistics
# Interleaved A/B so both see the same disk noise: A appends 168 B + fdatasync (the WAL today),
# B overwrites 168 B inside an already-written, synced file + fdatasync (a preallocated/recycled
# segment: no size change to journal).
n = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
d = sys.argv[2] if len(sys.argv) > 2 else os.path.join(os.path.dirname(__file__), "..", "target")
a = os.open(d + "/ab-append.dat", os.O_RDWR | os.O_CREAT | os.O_TRUNC)
b = os.open(d + "/ab-overwrite.dat", os.O_RDWR | os.O_CREAT | os.O_TRUNC)
os.write(b, b"\0" * (8 << 20)); os.fsync(b)
buf = b"x" * 168
ta, tb = [], []
for i in range(n):
    for fd, t in ((a, ta), (b, tb)) if i % 2 == 0 else ((b, tb), (a, ta)):
        s = time.perf_counter()
        os.pwrite(fd, buf, i * 168)
        os.fdatasync(fd)
        t.append(time.perf_counter() - s)
q = lambda t, p: sorted(t)[int(len(t) * p)] * 1e6
print(f"n={n}: append p50 {q(ta,.5):.0f} us p90 {q(ta,.9):.0f} mean {statistics.mean(ta)*1e6:.0f}; "
      f"overwrite p50 {q(tb,.5):.0f} us p90 {q(tb,.9):.0f} mean {statistics.mean(tb)*1e6:.0f}; "
      f"append/overwrite p50 {q(ta,.5)/q(tb,.5):.2f}x mean {statistics.mean(ta)/statistics.mean(tb):.2f}x")
for f in ("ab-append.dat", "ab-overwrite.dat"): os.unlink(d + "/" + f)
