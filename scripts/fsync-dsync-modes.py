#!/usr/bin/env python3
"""168-byte WAL appends into pre-zeroed space, made durable four ways, interleaved (the order
rotates each round) so every way sees the same disk noise:
  fdatasync   pwrite, then fdatasync (what the engine does)
  o_dsync     pwrite on an O_DSYNC descriptor
  rwf_dsync   pwritev2(RWF_DSYNC)
  direct      O_DIRECT|O_DSYNC: the 4 KiB blocks holding the record rewritten from an aligned
              buffer kept in step with the file (one block, two where the record crosses one)

Does making a write durable some other way than write + fdatasync beat fdatasync on this disk
(for one writer, which cannot share a flush)? Usage: scripts/fsync-dsync-modes.py ITERATIONS DIR
"""
import os, sys, time, statistics, mmap
n = int(sys.argv[1]); d = sys.argv[2]
rec = 168; size = n * rec + (1 << 20)
def mk(name, extra=0):
    p = os.path.join(d, name)
    fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    os.pwrite(fd, b"\0" * size, 0); os.fsync(fd); os.close(fd)
    return os.open(p, os.O_RDWR | extra)
fds = {"fdatasync": mk("ds-a"), "o_dsync": mk("ds-b", os.O_DSYNC), "rwf_dsync": mk("ds-c"),
       "direct": mk("ds-d", os.O_DIRECT | os.O_DSYNC)}
buf = b"x" * rec
blk = mmap.mmap(-1, 8192)  # page-aligned, as O_DIRECT needs
t = {k: [] for k in fds}; names = list(fds)
for i in range(n):
    for k in names[i % 4:] + names[:i % 4]:
        fd = fds[k]; off = i * rec
        s = time.perf_counter()
        if k == "fdatasync":
            os.pwrite(fd, buf, off); os.fdatasync(fd)
        elif k == "o_dsync":
            os.pwrite(fd, buf, off)
        elif k == "rwf_dsync":
            os.pwritev(fd, [buf], off, os.RWF_DSYNC)
        else:
            b0 = off // 4096 * 4096
            o = off - b0
            blk[o:o + rec] = buf
            span = 8192 if o + rec > 4096 else 4096
            os.pwritev(fd, [memoryview(blk)[:span]], b0)
            if span == 8192:  # the next record starts in the second block: slide it down
                blk[:4096] = blk[4096:]
                blk[4096:] = bytes(4096)
            elif o + rec == 4096:  # the next record starts a new block
                blk[:4096] = bytes(4096)
        t[k].append(time.perf_counter() - s)
for k in names:
    v = sorted(t[k]); print(f"{k:10s} p50 {v[len(v)//2]*1e6:7.1f} us  mean {statistics.mean(v)*1e6:7.1f} us  p99 {v[int(len(v)*.99)]*1e6:7.1f} us")
for fd in fds.values(): os.close(fd)
