"""make_text_corpus.py OUT: a byte-level text corpus that every machine with the project's torch can rebuild
without a download: the Python sources of the installed torch package (2.11.0: 2141 files, ~41 MB), concatenated
in byte order of their paths relative to the package, each preceded by a `# file: <path>` line. Real text (code,
docstrings, comments), the same bytes on every machine with the same torch version; train_gpt's `--data OUT`
(format text) keeps the last 10% as its held-out split. Prints one JSON line: path, bytes, files, sha256, torch."""
import hashlib
import json
import os
import sys

import torch


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: make_text_corpus.py OUT")
    out = sys.argv[1]
    root = os.path.dirname(torch.__file__)
    rel = sorted((os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs
                  if f.endswith(".py")), key=lambda p: p.encode())
    digest = hashlib.sha256()
    tmp = out + ".partial"  # no partial file under the final name
    with open(tmp, "wb") as w:
        for p in rel:
            with open(os.path.join(root, p), "rb") as r:
                chunk = b"# file: " + p.encode() + b"\n" + r.read() + b"\n"
            digest.update(chunk)
            w.write(chunk)
    os.replace(tmp, out)
    print(json.dumps({"path": out, "bytes": os.path.getsize(out), "files": len(rel),
                      "sha256": digest.hexdigest(), "torch": torch.__version__}))


if __name__ == "__main__":
    main()
