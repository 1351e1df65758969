#!/usr/bin/env bash
# Installs what bmtrain needs on Debian 12, idempotently: compilers and build tools, GoogleTest (the C++ tests),
# and the Python packages (LibTorch comes from pip torch==2.11.0, the GPU machine's version). gloo's and
# nlohmann-json's headers are in third_party/, not system packages (docs/design.md, "Dependencies"). CUDA + NCCL
# are optional: the CUDA build is enabled when nvcc is found (the CUDA 13 toolkit is not a Debian package; it is
# preinstalled on our machines).
set -euo pipefail

APT_PACKAGES=(cmake ninja-build g++ make git libgtest-dev clang ccache python3 python3-dev python3-pip python3-venv ca-certificates)
# transformers: pinned to the version tests/examples/test_hf_import.py was checked with (torch 2.11, CPU).
PIP_PACKAGES=("torch==2.11.0" numpy pytest safetensors "transformers==5.24.0" scikit-build-core)

missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "[setup] apt-get install ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
pip_args=(-q)
# Debian's own python3 refuses system-wide pip installs (PEP 668) unless told otherwise.
if "$PY" -c 'import sys, sysconfig, os; sys.exit(0 if os.path.exists(os.path.join(sysconfig.get_paths()["stdlib"], "EXTERNALLY-MANAGED")) else 1)'; then
  pip_args+=(--break-system-packages)
fi
need_pip=()
for spec in "${PIP_PACKAGES[@]}"; do
  name=${spec%%==*}
  want=${spec#*==}
  have=$("$PY" -c "import importlib.metadata as m; print(m.version('$name'))" 2>/dev/null || true)
  if [ -z "$have" ] || { [ "$want" != "$spec" ] && [ "${have%%+*}" != "$want" ]; }; then need_pip+=("$spec"); fi
done
if [ ${#need_pip[@]} -gt 0 ]; then
  echo "[setup] pip install ${need_pip[*]}"
  "$PY" -m pip install "${pip_args[@]}" "${need_pip[@]}"
fi
echo "[setup] ok: torch $("$PY" -c 'import torch; print(torch.__version__)'), cmake $(cmake --version | head -1 | awk '{print $3}'), nvcc: $(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null || echo none)"
