#!/usr/bin/env bash
# The hooks' overhead on a GPU, this checkout against an older tree, in turn on one machine
# (machines of one kind differ by more than a small change: docs/benchmarks.md).
# Usage: bash bench/hook_overhead_ab.sh OLD_TREE [ROUNDS_EACH]
#   OLD_TREE: the older hooks, e.g. made by
#     mkdir old && git archive REV trainvitals trainer hooks collector analyzer dashboard | tar -x -C old
# Each run: bench/hook_overhead.py, 125m, 16 x 1024 tokens, statistics every 10 steps
# (PRESET, BATCH and ROUNDS override them: PRESET=tiny BATCH=2 ROUNDS=3 tries it on a CPU).
# The last line: the median overhead of each side.
set -u
if [ $# -lt 1 ] || [ ! -d "$1/hooks" ] || [ ! -d "$1/trainvitals" ]; then
    echo "usage: bash bench/hook_overhead_ab.sh OLD_TREE [ROUNDS_EACH]: OLD_TREE must hold" \
        "the older trainvitals/ and hooks/ (see the comment at the top)" >&2
    exit 2
fi
old=$(realpath "$1")
rounds=${2:-2}
if ! [[ $rounds =~ ^[1-9][0-9]*$ ]]; then
    echo "ROUNDS_EACH must be a whole number >= 1, got '$rounds'" >&2
    exit 2
fi
repo=$PWD
shim() {  # the component folders of tree $1 under the trainvitals namespace
    local d
    d=$(mktemp -d)
    cp -r "$1/trainvitals" "$d/"
    for c in trainer hooks collector analyzer dashboard; do ln -s "$(realpath "$1/$c")" "$d/trainvitals/$c"; done
    echo "$d"
}
run() {  # label tree -> prints the figure
    (cd "$2" && PYTHONPATH="$2" PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 \
        "$repo/bench/hook_overhead.py" --dp 1 --tp 1 --preset "${PRESET:-125m}" --batch "${BATCH:-16}" --rounds "${ROUNDS:-30}" \
        --steps-per-block 10 --intervals 10 2>&1 | grep -v Warning | tail -1 \
        | sed -n 's/.*: \([-+0-9.]*\)% (95%.*/\1/p')
}
new_tree=$(shim "$repo")
old_tree=$(shim "$old")
news=() olds=()
for i in $(seq 1 "$rounds"); do
    n=$(run new "$new_tree"); o=$(run old "$old_tree")
    echo "round $i: now ${n}%, before ${o}%"
    news+=("$n") olds+=("$o")
done
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}'; }
echo "hook overhead at the default interval, median of $rounds: now $(median "${news[@]}")%, before $(median "${olds[@]}")%"
