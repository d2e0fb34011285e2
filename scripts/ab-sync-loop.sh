#!/bin/bash
# Interleaved A/B of the fresh-store user loop (`sync_loop`) between two builds of it.
# Usage: scripts/ab-sync-loop.sh BEFORE_BIN AFTER_BIN [WRITERS] [SECONDS] [PAIRS] [DIR]
# Build each side with `cargo build --release -p keeldb --example sync_loop` at its commit and
# copy target/release/examples/sync_loop away. Pair i runs before then after (odd i) or after
# then before (even i), each on a fresh store under DIR; prints "i side <sync_loop's total line>".
# Per-pair ratios (after/before) are the figure to quote: the disk's state changes within minutes.
set -eu
before=$1; after=$2; W=${3:-1}; S=${4:-2}; N=${5:-30}; dir=${6:-target}
store="$dir/ab-sync-loop-store"
for i in $(seq 1 "$N"); do
  if [ $((i % 2)) = 1 ]; then order="before after"; else order="after before"; fi
  for v in $order; do
    rm -rf "$store"
    if [ "$v" = before ]; then bin=$before; else bin=$after; fi
    echo "$i $v $("$bin" "$W" "$S" "$store" | tail -1)"
  done
done
rm -rf "$store"
