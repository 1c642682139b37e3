#!/usr/bin/env bash
# Quick start: set up (Debian packages, .venv) and run the main job on the embedded sample
# dataset: hubd + a spokefs mount + reads through it + the cache metrics, then a clean unmount.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/setup.sh
exec .venv/bin/python deploy/quickstart.py "$@"
