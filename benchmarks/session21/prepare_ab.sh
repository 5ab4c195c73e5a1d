#!/usr/bin/env bash
# Builds the packages next_call.sh compares, each into benchmarks/session21/ab_NAME/moeserve (untracked; they travel
# with the working tree): main as it is; "norm" = main with session 20's input norm q|k|v shrink at one row re-applied
# (the revert c3600cf reverted: norm_shrink.patch, its conflicts with session 21's changes resolved); "down" = main with the decode MoE's down shrink in the gate_up GEMV's epilogue
# re-applied (the revert 6a83e53 reverted). Both were reverted on A/Bs that compared a tree with itself or two
# machines (BENCHMARKS.md, session 21). "fp8pre" = main without session 21's FP8 dense LoRA epilogue (a33518f
# reverted): the "before" of that change. Only moeserve/ is taken; a conflict outside it (tests) is ignored.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=$PWD/benchmarks/session21
rm -rf "$out"/ab_main "$out"/ab_norm "$out"/ab_down "$out"/ab_fp8pre
mkdir -p "$out"/ab_main && git archive HEAD moeserve | tar -x -C "$out"/ab_main
mkdir -p "$out"/ab_norm && cp -r "$out"/ab_main/moeserve "$out"/ab_norm/
git apply --directory=benchmarks/session21/ab_norm "$out"/norm_shrink.patch  # c3600cf reverted, resolved against main in session 21
for pair in down:6a83e53 fp8pre:a33518f; do
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
