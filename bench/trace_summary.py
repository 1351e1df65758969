#!/usr/bin/env python3
"""trace_summary.py: where a step's time goes, from a torch.profiler chrome trace (plain or .gz).

Prints the wall time between the first and last event, the GPU's busy time (union of its kernel and memcpy
intervals, so overlapping streams count once), the idle share, the busiest kernels and the host ops with the
most self time. Used by torchops_gpt.py --profile; also runs alone:

  python3 bench/trace_summary.py trace.json.gz [--top 15]
"""
import argparse
import collections
import gzip
import json


def load(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def union_us(intervals):
    """Total length of the union of [start, end) intervals (µs)."""
    total, end = 0.0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def summarize(events, top=15):
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    gpu = [e for e in spans if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    host = [e for e in spans if e.get("cat") in ("cpu_op", "python_function", "user_annotation")]
    lines = []
    if not spans:
        return "trace_summary: no timed events"
    t0 = min(e["ts"] for e in spans)
    t1 = max(e["ts"] + e["dur"] for e in spans)
    busy = union_us((e["ts"], e["ts"] + e["dur"]) for e in gpu)
    kernel_sum = sum(e["dur"] for e in gpu)
    lines.append(f"wall {(t1 - t0) / 1e3:.2f} ms | GPU busy {busy / 1e3:.2f} ms ({100 * busy / max(t1 - t0, 1):.1f}%), "
                 f"idle {(t1 - t0 - busy) / 1e3:.2f} ms | kernel time summed over streams {kernel_sum / 1e3:.2f} ms, "
                 f"{len(gpu)} kernels/copies")
    by_kernel = collections.Counter()
    n_kernel = collections.Counter()
    for e in gpu:
        by_kernel[e["name"][:90]] += e["dur"]
        n_kernel[e["name"][:90]] += 1
    lines.append(f"top GPU kernels (ms total, count):")
    for name, us in by_kernel.most_common(top):
        lines.append(f"  {us / 1e3:9.2f} {n_kernel[name]:6d}  {name}")
    # host self time: an op's duration minus its direct children's (same thread)
    by_tid = collections.defaultdict(list)
    for e in host:
        by_tid[(e.get("pid"), e.get("tid"))].append(e)
    self_us, n_host = collections.Counter(), collections.Counter()
    for evs in by_tid.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []
        for e in evs:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            if stack:
                self_us[stack[-1]["name"][:90]] -= e["dur"]
            self_us[e["name"][:90]] += e["dur"]
            n_host[e["name"][:90]] += 1
            stack.append(e)
    lines.append("top host ops by self time (ms, count):")
    for name, us in self_us.most_common(top):
        lines.append(f"  {us / 1e3:9.2f} {n_host[name]:6d}  {name}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=15)
    a = ap.parse_args()
    print(summarize(load(a.trace), a.top))


if __name__ == "__main__":
    main()
