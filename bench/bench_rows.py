"""What the Python benchmarks' JSON rows share: the commit, the machine and the time of a row, appending rows to a
results file, and the two shell helpers their set-up uses."""
import datetime
import json
import os
import socket
import subprocess

_HERE = os.path.dirname(os.path.abspath(__file__))


def shell(cmd):
    """The command's stripped stdout; empty when it fails or takes over 10 s."""
    try:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001
        return ""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def git_commit():
    """BMT_GIT_COMMIT, else this checkout's short HEAD, else "unknown" (a copy without .git, as on a GPU machine)."""
    return (os.environ.get("BMT_GIT_COMMIT") or shell(f"git -C '{_HERE}' rev-parse --short HEAD 2>/dev/null")
            or "unknown")


def machine():
    """BMT_BENCH_MACHINE, else the host name."""
    return os.environ.get("BMT_BENCH_MACHINE") or socket.gethostname()


def utc_now():
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def append_rows(path, rows):
    """One JSON line per row, appended to path."""
    with open(path, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
