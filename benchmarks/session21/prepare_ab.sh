#!/usr/bin/env bash
# Builds the packages next_call.sh compares, each into benchmarks/session21/ab_NAME/moeserve (untracked; they travel
# with the working tree): main as it is; "norm" = main with session 20's input norm q|k|v shrink at one row re-applied
# (the revert c3600cf reverted); "down" = main with the decode MoE's down shrink in the gate_up GEMV's epilogue
# re-applied (the revert 6a83e53 reverted). Both were reverted on A/Bs that compared a tree with itself or two
# machines (BENCHMARKS.md, session 21). Only moeserve/ is taken; a conflict outside it (tests) is ignored.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=$PWD/benchmarks/session21
rm -rf "$out"/ab_main "$out"/ab_norm "$out"/ab_down
mkdir -p "$out"/ab_main && git archive HEAD moeserve | tar -x -C "$out"/ab_main
for pair in norm:c3600cf down:6a83e53; do
  name=${pair%%:*}; rev=${pair#*:}
  wt=$(mktemp -d)
  git worktree add -q --detach "$wt" HEAD
  (cd "$wt" && git revert --no-commit "$rev" >/dev/null 2>&1 || true
   if git diff --name-only --diff-filter=U | grep -q '^moeserve/'; then echo "conflict in moeserve/ for $name" >&2; exit 1; fi)
  mkdir -p "$out"/ab_$name && cp -r "$wt"/moeserve "$out"/ab_$name/
  git worktree remove --force "$wt"
done
find "$out"/ab_* -name __pycache__ -prune -exec rm -rf {} +
echo "prepared: $(ls -d "$out"/ab_*)"
