#!/usr/bin/env bash
# miniddp on one NVIDIA GPU: one line per check (PASS / FAIL / SKIP), then the failures' logs.
#
#   bash benchmarks/gpu_check.sh          # about 3 minutes on one H200; needs torch and pytest only
#
# Nothing outside the repository is needed (no network, no pip): the repository goes on
# PYTHONPATH. One GPU cannot hold two NCCL ranks ("Duplicate GPU detected"), so NCCL runs
# at world size 1, and the two-rank checks use gloo on CUDA tensors sharing the one GPU.
# Record what it prints on docs/testing.md ("On a GPU").
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
logs=$(mktemp -d)
failed=0

check() {  # check NAME COMMAND...: PASS/FAIL in one line, the log kept for the end
    local name=$1 log="$logs/$(echo "$1" | tr -c 'a-zA-Z0-9' _).log" start=$SECONDS
    shift
    if timeout 600 "$@" >"$log" 2>&1; then
        local last
        last=$(grep -E "^(PASS|SKIP)|passed|final:" "$log" | tail -n 1)
        echo "PASS $name ($((SECONDS - start)) s) ${last:0:160}"
    else
        echo "FAIL $name ($((SECONDS - start)) s): see below"
        failed=1
    fi
}

if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "SKIP every check: no CUDA device visible to torch ($PY)"
    exit 0
fi
$PY -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'on', torch.cuda.get_device_name(0), \
'x', torch.cuda.device_count(), 'NCCL', '.'.join(map(str, torch.cuda.nccl.version())))"

# The CUDA- and NCCL-marked tests. Files that need hypothesis or Jupyter run only if those are installed.
files="tests/test_ddp.py tests/test_env.py tests/test_backend.py tests/test_timeouts.py tests/test_manual_ddp.py tests/test_desync.py"
$PY -c "import hypothesis" 2>/dev/null && files="$files tests/test_averaging.py tests/test_sharding.py"
check "pytest: nccl- and cuda-marked tests" $PY -m pytest -q -p no:cacheprovider -o addopts="" -rs \
    -k "nccl or cuda or device_ids or gpu" $files
check "parity with torch DDP on CUDA (2 gloo ranks)" $PY benchmarks/gpu_check.py parity
check "timeline on CUDA" $PY benchmarks/gpu_check.py timeline
run_train() { $PY -m torch.distributed.run --standalone "$@" -m miniddp.train --max_steps 60 --disable_tqdm true; }
check "trainer: CUDA + NCCL, world 1" run_train --nproc-per-node 1 --output_dir "$logs/nccl" --ddp_backend nccl
check "trainer: CUDA + gloo, world 2 (one GPU shared)" run_train --nproc-per-node 2 --output_dir "$logs/gloo" \
    --ddp_backend gloo
check "trainer: bf16 autocast on CUDA" run_train --nproc-per-node 1 --output_dir "$logs/bf16" --mixed_precision bf16
check "trainer: metrics.json says cuda was used" $PY -c "
import json, sys
m = json.load(open('$logs/gloo/metrics.json'))
print('PASS', {k: m[k] for k in ('world_size', 'backend', 'global_step', 'train_loss')})
sys.exit(0 if m['world_size'] == 2 and m['backend'] == 'gloo' else 1)"

if [ "$failed" -ne 0 ]; then
    for log in "$logs"/*.log; do
        if ! grep -qE "^PASS|passed" "$log"; then echo "---- $(basename "$log")"; tail -n 40 "$log"; fi
    done
fi
exit $failed
