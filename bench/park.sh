#!/usr/bin/env bash
# The device tool sends the working tree with each call, 64 MiB with the carried bundle (.carry: ~63.7 MB), and the
# tree with the raw results and the lab notebook is over it (s67: refused). None of them is read on the device.
#   bash bench/park.sh out   # before device calls: moves them to $PARK (default /tmp/k3tune-parked), prints the size
#   bash bench/park.sh in    # after them, before any commit: moves them back
# The landing's inputs (bench/s63_*.sqlite.xz, bench/s67_*.sqlite.xz) stay in the tree.
set -euo pipefail
cd "$(dirname "$0")/.."
park=${PARK:-/tmp/k3tune-parked}
case "${1:-}" in
  out)
    mkdir -p "$park/results"
    for f in bench/results/*.xz; do [ -e "$f" ] && mv "$f" "$park/results/"; done
    for f in bench/s58_h100_new.sqlite.xz NOTES.md; do [ -e "$f" ] && mv "$f" "$park/"; done
    tree=$( (git ls-files -z | xargs -0 stat -c %s 2>/dev/null || true) | awk '{s += $1} END {print s + 0}')
    carry=$(du -sb .carry 2>/dev/null | cut -f1); carry=${carry:-0}
    echo "parked in $park; tree $tree + .carry $carry = $((tree + carry)) of $((64 * 1024 * 1024)) bytes" ;;
  in)
    [ -d "$park" ] || { echo "park: nothing parked in $park"; exit 1; }
    for f in "$park"/results/*.xz; do [ -e "$f" ] && mv "$f" bench/results/; done
    [ -e "$park/s58_h100_new.sqlite.xz" ] && mv "$park/s58_h100_new.sqlite.xz" bench/
    [ -e "$park/NOTES.md" ] && mv "$park/NOTES.md" .
    rmdir "$park/results" "$park"
    git status --short ;;
  *) echo "usage: bash bench/park.sh out|in"; exit 2 ;;
esac
