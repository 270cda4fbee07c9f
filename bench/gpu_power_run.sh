#!/usr/bin/env bash
# Two real runs of the reference trainer on one CUDA GPU into a collector's store, for the
# dashboard's power views and screenshots: "gpu-baseline" (clean) and "gpu-faulty" (a
# straggler phase, during which the GPU idles and its power falls, then a bad batch).
# NVML gives power and energy. The store is written to OUTDIR/gpu_runs.duckdb; view it with
#   trainvitals dashboard --store OUTDIR/gpu_runs.duckdb
#   python docs/screenshots.py --store OUTDIR/gpu_runs.duckdb --run gpu-faulty --views Overview --suffix power
# Usage: bash bench/gpu_power_run.sh OUTDIR [STEPS]   (the project importable, or a shim is made)
set -u
out=$(realpath -m "${1:-gpu-power}")
steps=${2:-300}
repo=$PWD
mkdir -p "$out"
if [ "${SHIM:-0}" = 1 ] || ! python3 -c "import trainvitals.hooks" 2>/dev/null; then
    # No install: expose the component folders under the trainvitals namespace (as in
    # bench/gpu_check.sh), run from the shim so the checkout's trainvitals/ does not shadow it.
    shim=$(mktemp -d)
    cp -r trainvitals "$shim/"
    for c in trainer hooks collector analyzer dashboard supervisor; do ln -s "$repo/$c" "$shim/trainvitals/$c"; done
    export PYTHONPATH="$shim${PYTHONPATH:+:$PYTHONPATH}"
    cd "$shim"
fi
export PYTHONUNBUFFERED=1
port=8731
url=http://127.0.0.1:$port
python3 -m trainvitals collector --store "$out/gpu_runs.duckdb" --port $port >"$out/collector.log" 2>&1 &
collector=$!
for _ in $(seq 60); do curl -sf $url/healthz >/dev/null && break; sleep 0.5; done
train() {  # run-id, then --inject flags
    local run=$1; shift
    echo "== $run ($(date +%T))"
    python3 -m trainvitals train --nproc 1 --device "${DEVICE:-cuda}" --preset "${PRESET:-125m}" --steps "$steps" \
        --global-batch 16 --log-every 4 --canary-every 8 --run-id "$run" --collector $url "$@" \
        2>&1 | grep -v Warning | tail -3
}
train gpu-baseline
third=$((steps / 3))
train gpu-faulty --inject "straggler:rank=0,step=$third,slowdown=1.0" \
    --inject "spike:step=$((2 * third))"
sleep 5  # the live analysis runs about a second behind the last commit
curl -s "$url/api/v1/runs" | python3 -c "import json,sys; [print(r) for r in json.load(sys.stdin)]" || true
curl -s "$url/metrics" | grep -E "^trainvitals_(power|energy)" | head -12 | tee "$out/power_metrics.txt"
kill -TERM $collector; wait $collector
ls -la "$out"
python3 "$repo/bench/power_summary.py" "$out/gpu_runs.duckdb" --phase-steps "$third" \
    | tee "$out/power_summary.txt"
