#!/usr/bin/env bash
# Builds the packages next_call.sh compares, each into benchmarks/session21/ab_NAME/moeserve (untracked; they travel
# with the working tree). Only moeserve/ is taken.
#   on 50241f1 (main before the norms' FP8 copies, which neither bf16 nor FP8 at 1-2 rows runs):
#     base   50241f1 as it is
#     norm   + session 20's input-norm q|k|v shrink at one row (norm_shrink.patch: c3600cf reverted, resolved on it)
#     down   + the decode MoE down shrink in the gate_up GEMV's epilogue (the revert 6a83e53 reverted)
#     fp8pre - the FP8 dense LoRA expand in the product's epilogue (a33518f reverted): FP8 B = 1, 2 active
#   on HEAD:
#     main       HEAD as it is
#     fp8quant   without the norms' fp8 copies for W8A8 consumers (33b8c1a the review's reshaping, f5ffe41 q|k|v,
#                b3bfdc0 experts reverted): B = 64, 256
# Both bf16 changes were reverted on A/Bs that compared a tree with itself or two machines (BENCHMARKS.md, session 21).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=$PWD/benchmarks/session21
rm -rf "$out"/ab_*
mkdir -p "$out"/ab_base "$out"/ab_main
git archive 50241f1 moeserve | tar -x -C "$out"/ab_base
git archive HEAD moeserve | tar -x -C "$out"/ab_main
mkdir -p "$out"/ab_norm && cp -r "$out"/ab_base/moeserve "$out"/ab_norm/
git apply --directory=benchmarks/session21/ab_norm "$out"/norm_shrink.patch
for spec in down:50241f1:6a83e53 fp8pre:50241f1:a33518f fp8quant:HEAD:33b8c1a,f5ffe41,b3bfdc0; do
  IFS=: read -r name base revs <<< "$spec"
  wt=$(mktemp -d)
  trap 'git worktree remove --force "$wt" 2>/dev/null || true' EXIT  # also when a revert conflicts
  git worktree add -q --detach "$wt" "$base"
  (cd "$wt" && for rev in ${revs//,/ }; do git revert --no-commit "$rev" >/dev/null 2>&1 || true; done
   if git diff --name-only --diff-filter=U | grep -q '^moeserve/'; then echo "conflict in moeserve/ for $name" >&2; exit 1; fi)
  mkdir -p "$out"/ab_$name && cp -r "$wt"/moeserve "$out"/ab_$name/
  git worktree remove --force "$wt"
done
find "$out"/ab_* -name __pycache__ -prune -exec rm -rf {} +
for name in norm down; do echo "ab_$name: $(diff -rq "$out"/ab_base "$out"/ab_$name | wc -l) files differ from ab_base"; done
echo "ab_fp8pre: $(diff -rq "$out"/ab_base "$out"/ab_fp8pre | wc -l) files differ from ab_base"
echo "ab_fp8quant: $(diff -rq "$out"/ab_main "$out"/ab_fp8quant | wc -l) files differ from ab_main"
