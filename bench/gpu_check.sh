#!/usr/bin/env bash
# The GPU checks, in one run on a CUDA machine: the hooks' no-sync and correctness tests on
# CUDA, a reference-trainer run on NCCL through torchrun, injected stragglers (busy and idle) on CUDA,
# where the hooks' time goes, and their overhead on GPU.
# Usage: bash bench/gpu_check.sh OUTDIR   (the project importable, or this script makes a shim)
set -u
out=$(realpath -m "${1:-gpu-check}")
repo=$PWD
mkdir -p "$out"
if ! python3 -c "import trainvitals.hooks" 2>/dev/null; then
    # No install: expose the component folders under the trainvitals namespace, and run from
    # the shim so that the checkout's own trainvitals/ folder does not shadow it.
    shim=$(mktemp -d)
    cp -r trainvitals "$shim/"
    for c in trainer hooks collector analyzer dashboard; do ln -s "$repo/$c" "$shim/trainvitals/$c"; done
    export PYTHONPATH="$shim${PYTHONPATH:+:$PYTHONPATH}"
    cd "$shim"
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,power.draw,clocks.sm --format=csv | tee "$out/nvidia-smi.txt"
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"

echo "== hooks on CUDA: no host sync, records match torch ($(date +%T))"
python3 -m pytest -q -p no:cacheprovider --import-mode=importlib --rootdir "$repo" -m gpu \
    "$repo/tests/hooks/test_gpu.py" "$repo/tests/hooks/test_comms_gpu.py" \
    "$repo/tests/hooks/test_nvml_gpu.py" 2>&1 | tail -15 | tee "$out/gpu_tests.txt"
overhead() {  # preset batch rounds intervals
    echo "== hook overhead on GPU, preset $1 ($(date +%T))"
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 "$repo/bench/hook_overhead.py" \
        --dp 1 --tp 1 --preset "$1" --batch "$2" --rounds "$3" \
        --steps-per-block 10 --intervals "$4" 2>&1 | grep -v Warning \
        | tee "$out/overhead_${1}_${4/,/_}.txt"
}
# The headline figure first, so that a short loan measures it even if it runs out later.
[ "${SKIP_OVERHEAD:-0}" = 1 ] || overhead 125m 16 30 10,1
echo "== NVML readings ($(date +%T))"
python3 "$repo/bench/nvml_probe.py" 2>&1 | tail -30 | tee "$out/nvml_probe.txt"

if [ "${SKIP_TRAINER:-0}" != 1 ]; then
echo "== reference trainer on NCCL (torchrun, 1 rank), preset 125m ($(date +%T))"
python3 -m torch.distributed.run --standalone --nproc-per-node 1 -m trainvitals.trainer.train \
    --device cuda --preset 125m --steps 60 --global-batch 16 --telemetry-file "$out/nccl_run.jsonl" \
    2>&1 | grep -v Warning | tail -8 | tee "$out/nccl_run.txt"
python3 - "$out/nccl_run.jsonl" <<'PY' | tee -a "$out/nccl_run.txt"
import json, sys
tables = {}
for line in open(sys.argv[1]):
    for name, cols in json.loads(line).items():
        if isinstance(cols, dict):
            tables.setdefault(name, []).extend(dict(zip(cols, v)) for v in zip(*cols.values()))
run, steps, ranks = tables["runs"][0], tables["steps"], tables["ranks"]
last = steps[-1]
print(f"steps logged: {len(steps)}; last: loss {last['loss']:.3f}, tokens/s {last['tokens_per_s']:.0f}, "
      f"TFLOP/s/device {last['tflops_per_s_per_device']:.1f}, MFU {100 * last['mfu_ratio']:.1f}%")
print(f"peak {run['peak_flops_per_s']:.3g} FLOP/s ({run['peak_flops_source']}); "
      f"power source {run['power_source']!r} {run['power_unavailable']}")
r = ranks[-1]
print(f"last step, rank 0: power {r['power_w']} W, energy {r['energy_j']} J, "
      f"SM clock {r['sm_clock_mhz']} MHz, {r['temperature_c']} C; job energy {last['energy_j']} J")
print(f"last step, rank 0: compute {r['compute_time_s']} s (CUDA events), data {r['data_time_s']} s, "
      f"step {r['step_time_s']:.4f} s, memory {r['memory_used_bytes']} B, throttle 0x{r['throttle_reasons'] or 0:x}, "
      f"all-gather {r['all_gather_count']}/step {r['all_gather_bytes']} B, reduce-scatter {r['reduce_scatter_count']}/step")
layers = tables["layers"]
print(f"act_max_abs of the last step's layers: {[round(x['act_max_abs'], 2) for x in layers[-5:]]}")
prints = {x['canary_fingerprint'] for x in ranks if x['canary_fingerprint'] is not None}
print(f"canary fingerprints seen: {len(prints)} distinct over the run (1 expected on one healthy GPU)")
PY

echo "== straggler fault on CUDA (its clock: CUDA events), 125m, +50% from step 20 ($(date +%T))"
python3 -m torch.distributed.run --standalone --nproc-per-node 1 -m trainvitals.trainer.train \
    --device cuda --preset 125m --steps 40 --global-batch 16 --telemetry-file "$out/straggler.jsonl" \
    --inject straggler:rank=0,step=20,slowdown=0.5 2>&1 | grep -v Warning | tail -3
python3 "$repo/bench/straggler_check.py" "$out/straggler.jsonl" --from-step 20 --slowdown 0.5 \
    2>&1 | tee "$out/straggler.txt"
echo "== idle straggler on CUDA (the host sleeps in the first block's forward), +50% from step 20 ($(date +%T))"
python3 -m torch.distributed.run --standalone --nproc-per-node 1 -m trainvitals.trainer.train \
    --device cuda --preset 125m --steps 40 --global-batch 16 --telemetry-file "$out/straggler_idle.jsonl" \
    --inject straggler:rank=0,step=20,slowdown=0.5,how=idle 2>&1 | grep -v Warning | tail -3
python3 "$repo/bench/straggler_check.py" "$out/straggler_idle.jsonl" --from-step 20 --slowdown 0.5 \
    2>&1 | tee "$out/straggler_idle.txt"
fi
[ "${SKIP_OVERHEAD:-0}" = 1 ] && exit 0
echo "== where the hooks' time goes, 125m: host and device time of each hook per step ($(date +%T))"
python3 "$repo/bench/hook_breakdown.py" --preset 125m --batch 16 2>&1 | grep -v Warning \
    | tee "$out/breakdown_125m.txt"
# Each overhead run also has a plain copy and a control (see the script). QUICK=1 leaves out
# the 1b model's every-step copy, SKIP_1B=1 the 1b model. The 1b copies (three of them,
# with AdamW state) take about 40 GB: expandable segments keep fragmentation from tipping an
# 80 GB card over.
if [ "${SKIP_1B:-0}" = 1 ]; then :; elif [ "${QUICK:-0}" = 1 ]; then overhead 1b 8 10 10; else overhead 1b 8 10 10,1; fi
echo "== done ($(date +%T))"
