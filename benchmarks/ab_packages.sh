#!/usr/bin/env bash
# The packages an A/B on the device compares, each as benchmarks/ab/NAME/moeserve (ignored by git: carry
# "benchmarks/ab" with ".whl"). Each SPEC is NAME=REV (the package at REV) or NAME=REV~C1,C2 (at REV with commits
# C1, C2 reverted; a revert that conflicts inside moeserve/ stops the script). Run each side from inside its
# directory (device_env.sh's ab_decode does): from the repository root `python -m` would import the root's package.
#   bash benchmarks/ab_packages.sh main=HEAD before=HEAD~442e8db
set -euo pipefail
cd "$(dirname "$0")/.."
out=$PWD/benchmarks/ab
# every name must be a commit before anything is removed: git's own REV~N reads as "REV with commit N reverted" here,
# and a revert of no commit would otherwise pass silently as the whole of REV
for spec in "$@"; do
  rev=${spec#*=}
  for c in ${rev%%~*} $([[ $rev == *~* ]] && echo "${rev#*~}" | tr , ' '); do
    git rev-parse -q --verify "$c^{commit}" >/dev/null \
      || { echo "ab_packages: ${spec%%=*}: '$c' is no commit (for an ancestor, name it by its hash)" >&2; exit 1; }
  done
done
rm -rf "$out"
mkdir -p "$out"
for spec in "$@"; do
  name=${spec%%=*} rev=${spec#*=}
  base=${rev%%~*} reverts=
  [[ $rev == *~* ]] && reverts=${rev#*~}
  mkdir -p "$out/$name"
  if [[ -z $reverts ]]; then
    git archive "$base" moeserve | tar -x -C "$out/$name"
  else
    wt=$(mktemp -d)
    git worktree add -q --detach "$wt" "$base"
    (cd "$wt" && for c in ${reverts//,/ }; do git revert --no-commit "$c" >/dev/null 2>&1 || true; done
     if git diff --name-only --diff-filter=U | grep -q '^moeserve/'; then echo "ab_packages: $name: a revert conflicts in moeserve/" >&2; exit 1; fi) \
      || { git worktree remove --force "$wt"; exit 1; }
    cp -r "$wt"/moeserve "$out/$name/"
    git worktree remove --force "$wt"
  fi
  find "$out/$name" -name __pycache__ -prune -exec rm -rf {} +
  echo "ab_packages: $name = $rev ($(find "$out/$name" -name '*.py' | wc -l) files)"
done
