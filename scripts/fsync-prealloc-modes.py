#!/usr/bin/env python3
"""168-byte write + fdatasync in four kinds of WAL space, interleaved (the order rotates each
round) so every mode sees the same disk noise:

  append     the write extends the file (the WAL before preallocation: each fdatasync also
             journals the new size)
  zeroed     overwrite inside a file whose bytes were written (zeros) and synced beforehand
  fallocate  overwrite inside fallocate(2)d space: unwritten extents, whose first write still
             converts the extent (metadata) at fdatasync
  chunked    what the engine does now: zeros written ahead in CHUNK-byte steps when the log
             reaches the end of what was written (no sync of its own: the next commit's
             fdatasync carries the chunk and the size once per chunk)

Usage: scripts/fsync-prealloc-modes.py [ITERATIONS] [DIR] [CHUNK]   (DIR defaults to target/)
"""
import os, sys, time, statistics
n = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
d = sys.argv[2] if len(sys.argv) > 2 else os.path.join(os.path.dirname(__file__), "..", "target")
chunk = int(sys.argv[3]) if len(sys.argv) > 3 else 1 << 20
rec = 168
size = n * rec + (1 << 20)
def f(name):
    return os.open(os.path.join(d, name), os.O_RDWR | os.O_CREAT | os.O_TRUNC)
fds = {"append": f("pm-append.dat"), "zeroed": f("pm-zeroed.dat"), "fallocate": f("pm-fallocate.dat"),
       "chunked": f("pm-chunked.dat")}
os.pwrite(fds["zeroed"], b"\0" * size, 0); os.fsync(fds["zeroed"])
os.posix_fallocate(fds["fallocate"], 0, size); os.fsync(fds["fallocate"])
# the chunked file starts empty, like a new segment after its header
allocated = 0
buf = b"x" * rec
t = {k: [] for k in fds}
names = list(fds)
for i in range(n):
    order = names[i % 4:] + names[:i % 4]
    for k in order:
        fd = fds[k]
        s = time.perf_counter()
        if k == "chunked" and (i + 1) * rec > allocated:
            new = ((i + 1) * rec + chunk - 1) // chunk * chunk
            os.pwrite(fd, b"\0" * (new - allocated), allocated)
            allocated = new
        os.pwrite(fd, buf, i * rec)
        os.fdatasync(fd)
        t[k].append(time.perf_counter() - s)
q = lambda v, p: sorted(v)[int(len(v) * p)] * 1e6
base = q(t["zeroed"], .5)
for k in names:
    v = t[k]
    print(f"{k:10} p50 {q(v,.5):6.0f} us  p90 {q(v,.9):6.0f}  p99 {q(v,.99):6.0f}  mean {statistics.mean(v)*1e6:6.0f}"
          f"  p50/zeroed {q(v,.5)/base:.2f}x")
for name in ("pm-append.dat", "pm-zeroed.dat", "pm-fallocate.dat", "pm-chunked.dat"):
    os.unlink(os.path.join(d, name))
