#!/usr/bin/env bash
# What a device call sends is the tracked files and the carried paths, at most 64 MiB; with `.whl/` (~57 MB) the
# tracked figures and earlier lease logs put it over (65 MiB at stop 66). No lease command reads them:
#
#   bash scripts/device_tree.sh hide      # before the device calls: out of git's index, ignored (the files stay)
#   bash scripts/device_tree.sh restore   # right after them, before any commit: back as they were
#
# `hide` leaves them on disk and commits nothing, but a commit made while they are hidden would delete them: restore
# first. It refuses while changes to them are staged (a restore would unstage them).
set -euo pipefail
cd "$(dirname "$0")/.."
PATHS=(docs/figures docs/results/superseded benchmarks/results/profiles)
EXCLUDE=.git/info/exclude
lines() { for p in "${PATHS[@]}"; do echo "/$p/"; done; }
case "${1:-}" in
  hide)
    if [ -f "$EXCLUDE" ] && [ "$(grep -cxF -f <(lines) "$EXCLUDE")" -eq "${#PATHS[@]}" ]; then
      echo "already hidden: ${PATHS[*]}"; exit 0
    fi
    if ! git diff --cached --quiet -- "${PATHS[@]}"; then
      echo "staged changes under ${PATHS[*]}: commit or unstage them first" >&2; exit 1
    fi
    git rm -r -q --cached --ignore-unmatch -- "${PATHS[@]}"
    mkdir -p "$(dirname "$EXCLUDE")"; touch "$EXCLUDE"
    lines | while read -r line; do grep -qxF "$line" "$EXCLUDE" || echo "$line" >> "$EXCLUDE"; done
    echo "hidden from the device call: ${PATHS[*]} (bash scripts/device_tree.sh restore after it)"
    ;;
  restore)
    git reset -q -- "${PATHS[@]}"
    if [ -f "$EXCLUDE" ]; then
      grep -vxF -f <(lines) "$EXCLUDE" > "$EXCLUDE.tmp" || true
      mv "$EXCLUDE.tmp" "$EXCLUDE"
    fi
    echo "restored: ${PATHS[*]}"
    ;;
  *) echo "usage: bash scripts/device_tree.sh hide|restore" >&2; exit 2 ;;
esac
