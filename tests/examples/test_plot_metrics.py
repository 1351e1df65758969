"""bmt-plot-metrics (tools/plot_metrics.cpp): writes a valid PNG (chunk CRCs, zlib stream, image size) from a
JSONL metrics log with null eval entries, and fails clearly on a log without losses.

Run through CTest (it sets BMT_PLOT_METRICS to the executable)."""
import json
import os
import struct
import subprocess
import zlib

import pytest


def tool():
    path = os.environ.get("BMT_PLOT_METRICS")
    if not path:
        pytest.fail("BMT_PLOT_METRICS is not set: run this test through ctest (it sets the tool's path)")
    return path


def read_png(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, []
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + n]
        (crc,) = struct.unpack(">I", data[pos + 8 + n : pos + 12 + n])
        assert zlib.crc32(kind + body) == crc, kind
        chunks.append((kind, body))
        pos += 12 + n
    return chunks


def test_png_from_metrics(tmp_path):
    log = tmp_path / "m.jsonl"
    lines = [{"step": 0, "loss": None, "eval_loss": 2.6, "task_acc": 0.0}]
    for s in range(1, 101):
        lines.append({"step": s, "loss": 2.6 * 0.99**s, "lr": 1e-3,
                      "eval_loss": 2.0 if s % 50 == 0 else None, "task_acc": 0.5 if s == 100 else None})
    log.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = tmp_path / "loss.png"
    subprocess.run([tool(), str(log), str(out)], check=True, timeout=60)
    chunks = read_png(out)
    assert [k for k, _ in chunks] == [b"IHDR", b"IDAT", b"IEND"]
    width, height, depth, color = struct.unpack(">IIBB", chunks[0][1][:10])
    assert (depth, color) == (8, 2)
    raw = zlib.decompress(chunks[1][1])
    assert len(raw) == height * (1 + 3 * width)
    assert len(set(raw)) > 3, "the image is not blank"


def test_log_without_losses_fails(tmp_path):
    log = tmp_path / "empty.jsonl"
    log.write_text('{"step": 1, "lr": 0.1}\n')
    r = subprocess.run([tool(), str(log), str(tmp_path / "x.png")], capture_output=True, text=True)
    assert r.returncode == 1 and "no loss values" in r.stderr


def test_full_disk_is_an_error_and_leaves_no_partial_png(tmp_path):
    """A file-size limit (ulimit -f 1: writes past 1 KiB fail with EFBIG) while writing the PNG: exit 1 with the
    path and the reason, the previous file at the final name untouched, no temporary file left."""
    log = tmp_path / "m.jsonl"
    log.write_text("\n".join(json.dumps({"step": s, "loss": 2.6 * 0.99**s}) for s in range(1, 201)) + "\n")
    out = tmp_path / "loss.png"
    out.write_bytes(b"previous")
    r = subprocess.run(["bash", "-c", f"ulimit -f 1; exec {tool()} {log} {out}"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"cannot write '{out}'" in r.stderr and "File too large" in r.stderr and "ulimit -f" in r.stderr, r.stderr
    assert out.read_bytes() == b"previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loss.png", "m.jsonl"]
