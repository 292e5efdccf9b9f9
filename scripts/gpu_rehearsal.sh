#!/usr/bin/env bash
# Rehearse, on this CPU machine, the software of the GPU machine a reference run goes to, before a GPU session is
# spent on it: that machine's Python (3.12) and torch (2.11.0 there, where .venv pins another), none of .venv's
# packages, only the wheels scripts/gpu_wheels.sh carries, installed as scripts/gpu_call.sh installs them. It then runs
# `scripts/gpu_call.sh --shakedown` (every notebook in smoke mode, past failures) from a clean worktree of HEAD, so
# a notebook or a package that would fail there for its Python, its torch or a missing wheel fails here instead.
#
#   bash scripts/gpu_rehearsal.sh                     # ~11 min on 2 cores: 2 to set up, 9 for the shakedown
#   TORCH=2.12.0 TORCHVISION=0.27.0 bash scripts/gpu_rehearsal.sh   # another image's pair
#
# It needs the package registry (for the venv) and python3.12 (pyenv's here). What it cannot rehearse is the GPU
# itself: every CUDA branch still needs the real machine. The executed notebooks and run.log land in
# $REHEARSAL_DIR/out (default /tmp/gpu_rehearsal/out); it exits with the shakedown's status.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH=${TORCH:-2.11.0}
TORCHVISION=${TORCHVISION:-0.26.0}
DIR=${REHEARSAL_DIR:-/tmp/gpu_rehearsal}
if [ -z "${PY312:-}" ]; then  # the first that runs: a pyenv shim is on the PATH even where its version is not selected
  for c in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
    if "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then PY312=$c; break; fi
  done
fi
[ -n "${PY312:-}" ] || { echo "gpu_rehearsal: no python3.12 runs here (the GPU machine's Python): set PY312" >&2; exit 2; }
ls .whl/*.whl > /dev/null 2>&1 || bash scripts/gpu_wheels.sh
rm -rf "$DIR" && mkdir -p "$DIR"
"$PY312" -m venv "$DIR/venv"
# What the GPU image has beside torch (/work/.library/device/KINDS.md, 'Python packages already there'), as far as
# the series uses it; the rest comes from .whl/ alone, as there
"$DIR/venv/bin/pip" install -q "torch==$TORCH" "torchvision==$TORCHVISION" numpy pandas matplotlib seaborn scipy \
  pillow psutil pytest pytest-xdist pytest-timeout
git worktree add -q --detach "$DIR/tree" HEAD
trap 'git worktree remove --force "$DIR/tree" 2>/dev/null || true' EXIT
cp -a .whl "$DIR/tree/.whl"
cd "$DIR/tree"
# gpu_call.sh installs the wheels into /tmp/site and runs `python3`: here the rehearsal venv's
PATH="$DIR/venv/bin:$PATH" OUT="$DIR/out" SHAKEDOWN_DIR="$DIR/shakedown" DEADLINE_S=${DEADLINE_S:-3000} \
  bash scripts/gpu_call.sh --shakedown
