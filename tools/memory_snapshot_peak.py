#!/usr/bin/env python3
"""What is live at the peak of a CUDA caching-allocator snapshot (bmt-bench-train --memory-snapshot PATH).

    python3 tools/memory_snapshot_peak.py SNAPSHOT.pickle [--top 25]

Needs only the standard library (the snapshot is a pickle of plain dicts and lists). The trace may be truncated
(BMT_MEMORY_SNAPSHOT_ENTRIES), so it is replayed BACKWARDS from the blocks allocated at the end ("segments"): an
"alloc" event means the block was not live before it, a "free_completed" that it was. At the moment with the
most live bytes the live blocks are grouped by size (parameter, gradient and optimizer tensors of a model have
few distinct sizes, so the sizes say what they are) and, when the snapshot has stack frames, by the first frame.
"""
import argparse
import collections
import pickle
import sys


def gib(n):
    return n / 2**30


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("snapshot")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--device", type=int, default=0)
    args = ap.parse_args()
    with open(args.snapshot, "rb") as f:
        snap = pickle.load(f)

    live = {}  # addr -> (size, frames)
    for seg in snap.get("segments", []):
        if seg.get("device", 0) != args.device:
            continue
        for blk in seg.get("blocks", []):
            if blk.get("state") == "active_allocated":
                live[blk["addr"]] = (blk.get("requested_size", blk["size"]), blk.get("frames", []))
    traces = snap.get("device_traces", [])
    trace = traces[args.device] if args.device < len(traces) else []
    total = sum(s for s, _ in live.values())
    best_total, best_live, best_index = total, dict(live), len(trace)
    for i in range(len(trace) - 1, -1, -1):
        ev = trace[i]
        action, addr, size = ev.get("action"), ev.get("addr"), ev.get("size", 0)
        if action == "alloc" and addr in live:
            total -= live.pop(addr)[0]
        elif action == "free_completed" and addr not in live:
            live[addr] = (size, ev.get("frames", []))
            total += size
        if total > best_total:
            best_total, best_live, best_index = total, dict(live), i
    print(f"{len(trace)} trace events; peak of live allocations {gib(best_total):.3f} GiB "
          f"({len(best_live)} blocks) at event {best_index}")
    reserved = sum(seg.get("total_size", 0) for seg in snap.get("segments", []) if seg.get("device", 0) == args.device)
    print(f"reserved at the end of the run: {gib(reserved):.3f} GiB")

    by_size = collections.Counter()
    count = collections.Counter()
    for size, _ in best_live.values():
        by_size[size] += size
        count[size] += 1
    print(f"\nlive at the peak by block size (top {args.top}):\n  {'size MiB':>12} {'count':>6} {'total GiB':>10}")
    for size, tot in by_size.most_common(args.top):
        print(f"  {size / 2**20:12.2f} {count[size]:6d} {gib(tot):10.3f}")

    by_frame = collections.Counter()
    for size, frames in best_live.values():
        name = frames[0].get("name", "?") if frames else None
        if name:
            by_frame[name] += size
    if by_frame:
        print(f"\nlive at the peak by first stack frame (top {args.top}):")
        for name, tot in by_frame.most_common(args.top):
            print(f"  {gib(tot):10.3f} GiB  {name[:150]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
