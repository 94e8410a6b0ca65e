#!/usr/bin/env python3
"""The rate at which a file can be read past the page cache (``O_DIRECT``) by N threads in chunks of C bytes: the
disk term of the disk tier's bound, by mechanism. Each row reads its own region of the file (no row finds another's
bytes anywhere), so the page cache plays no part.

    python3 benches/torch/read_rate.py FILE [--gb 2] [--threads 1,2,4,8,16] [--chunks-mib 1,8]
"""

import argparse
import mmap
import os
import threading
import time


def read_region(path, start, length, threads, chunk):
    """Reads ``length`` bytes from ``start`` with ``threads`` threads, ``chunk`` bytes per read: GB/s."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    offsets = list(range(start, start + length, chunk))
    lock = threading.Lock()
    state = {"next": 0}

    def worker():
        buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs
        while True:
            with lock:
                i = state["next"]
                state["next"] += 1
            if i >= len(offsets):
                return
            os.preadv(fd, [buf], offsets[i])

    pool = [threading.Thread(target=worker) for _ in range(threads)]
    t0 = time.perf_counter()
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    dt = time.perf_counter() - t0
    os.close(fd)
    return len(offsets) * chunk / dt / 1e9


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("file")
    ap.add_argument("--gb", type=float, default=2.0, help="bytes read per row")
    ap.add_argument("--threads", default="1,2,4,8,16")
    ap.add_argument("--chunks-mib", default="1,8")
    args = ap.parse_args()
    size = os.path.getsize(args.file)
    length = int(args.gb * 1e9) // (8 << 20) * (8 << 20)
    start = 0
    print(f"{'threads':>8} {'chunk MiB':>10} {'GB/s':>8}")
    for chunk_mib in [int(c) for c in args.chunks_mib.split(",")]:
        for threads in [int(t) for t in args.threads.split(",")]:
            if start + length > size:
                start = 0
                print("(file exhausted: regions start again from its beginning; drop the page cache is moot: O_DIRECT)")
            rate = read_region(args.file, start, length, threads, chunk_mib << 20)
            start += length
            print(f"{threads:>8} {chunk_mib:>10} {rate:>8.2f}", flush=True)


if __name__ == "__main__":
    main()
