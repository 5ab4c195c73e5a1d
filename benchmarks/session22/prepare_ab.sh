#!/usr/bin/env bash
# Builds the packages next_call.sh compares, each into benchmarks/session22/ab_NAME/moeserve (untracked; they travel
# with the working tree; only moeserve/ is taken):
#   main     HEAD as it is
#   noattn   HEAD without the decode attention's fp8 copy for o_proj (442e8db reverted)
set -euo pipefail
cd "$(dirname "$0")/../.."
out=$PWD/benchmarks/session22
rm -rf "$out"/ab_*
mkdir -p "$out"/ab_main
git archive HEAD moeserve | tar -x -C "$out"/ab_main
wt=$(mktemp -d)
trap 'git worktree remove --force "$wt" 2>/dev/null || true' EXIT
git worktree add -q --detach "$wt" HEAD
(cd "$wt" && git revert --no-commit 442e8db >/dev/null)
mkdir -p "$out"/ab_noattn && cp -r "$wt"/moeserve "$out"/ab_noattn/
find "$out"/ab_* -name __pycache__ -prune -exec rm -rf {} +
echo "ab_noattn: $(diff -rq "$out"/ab_main "$out"/ab_noattn | wc -l) files differ from ab_main"
