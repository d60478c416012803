#!/usr/bin/env bash
# One call's worth of GPU checks, for a lent GPU machine with PyTorch but no
# Java or TorchServe frontend (so handlers are driven in-process there).
#
#   bash bench/gpu_session.sh OUT_DIR [STEP...]   # steps: tests ebird_direct nimble nimble_compile (default: all)
#
# Needs TorchServe's Python package `ts` importable (the handlers raise its
# PredictionException); where it is not installed, copy it without the
# frontend jar into .site/ (ignored by git) and this script puts .site on
# PYTHONPATH.  Each step has its own time limit, so one slow step costs only
# itself; after every step the results so far are packed into
# OUT_DIR/results.tar (.md/.json/.png per benchmark, pytest's log).
set -u
out=${1:?usage: bash bench/gpu_session.sh OUT_DIR}
work=$(mktemp -d)
export PYTHONPATH="$PWD/.site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}

shift
steps=" ${*:-tests ebird_direct nimble nimble_compile} "
pack() { tar -cf "$out/results.tar" -C "$work" . ; }
step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2; shift 2
    [[ $steps == *" $name "* ]] || return 0
    local started=$SECONDS
    echo "=== $name (limit ${limit}s): $*"
    timeout -k 10 "$limit" "$@" >"$work/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$work/$name.log"
    echo "=== $name: rc=$rc in $((SECONDS - started))s"
    pack
}

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  "$py" -c 'import torch, torchvision, platform; print("python", platform.python_version(), "torch", torch.__version__, "torchvision", torchvision.__version__, "cuda", torch.cuda.is_available())'
  nproc; git rev-parse --short HEAD; git status --short | head; } >"$work/machine.txt" 2>&1
cat "$work/machine.txt"

# Every test that skips without CUDA (and the CUDA-default tests beside them).
step tests 150 "$py" -m pytest -q -p no:cacheprovider -rs \
    tests/test_ebird_handler.py tests/test_reef_engine.py tests/test_nimble_program.py \
    tests/test_plain_handler_direct.py tests/test_dvabatch_engine.py tests/test_orca_batch_generate.py \
    tests/test_multistream.py tests/test_ebird_policy.py tests/test_cuda_graphs.py \
    -k "cuda or gpu or captured_multi_stream or weights_alive"

# Ebird vs NO Wait on the GPU, the same shape of run as the first one
# (docs/benchmarks/ebird_direct_resnet50_cuda.md), on today's runtime.
step ebird_direct 150 "$py" -m bench.ebird_direct --device cuda --ebird-decode-threads auto \
    --fractions 0.3,0.85 --seconds 6 --repeats 2 --capacity-seconds 5 --warmup-seconds 2 --out-dir "$work"

# Nimble's captured graphs and streams against eager, three models, no
# torch.compile; then the same with torch.compile (reduce-overhead) beside.
step nimble 90 "$py" -m bench.nimble --device cuda --models resnet50,inception_v3,efficientnet_b0 \
    --batches 1,8,32 --repeats 3 --runs 10 --no-compile --out-dir "$work"
step nimble_compile 200 "$py" -m bench.nimble --device cuda --models resnet50,inception_v3,efficientnet_b0 \
    --batches 1,8,32 --repeats 3 --runs 10 --suffix _compile --out-dir "$work"
ls -la "$work"
