#!/usr/bin/env bash
# One lent GPU session's checks, in tiers ordered by value, for a machine with
# PyTorch but no Java or TorchServe frontend (so handlers are driven in-process).
#
#   bash bench/gpu_session.sh OUT_DIR TIER|STEP...     # e.g. `0a`, `1`, `2`, `tests ebird`, `all`
#   DRY=1 bash bench/gpu_session.sh /tmp/dry all       # the same steps on this CPU, tiny runs
#
# A device call runs ten minutes at most, so tier 0 comes as two calls, `0a`
# (new_cuda hostbound ebird_same: step limits 490 s in all) and then `0b`
# (hostbound_reef dvabatch orca: 500 s); each call packs its own results.tar.
#
# Tier 0 (about 13 minutes; prepared 2026-11-28/29, no loan since): the new
# CUDA code's tests (new_cuda: REEF green contexts and BE graphs, Orca decode
# graphs, never run on a GPU), the host
# path after the loop mailbox, lane decode jobs per burst, torch work and
# loop wake-ups once per batch (docs/benchmarks/host_path.md), DVABatch's
# stages as CUDA graphs per batch bucket, and Orca's one attention call per
# layer per iteration with its decode iterations as CUDA graphs: the
# host-bound regime on the card (Ebird and DVABatch against NO Wait on the
# one-layer BERT, twin beside: hostbound), Ebird against NO Wait with the
# same execution (ebird_same), DVABatch on BERT-base, Orca on GPT-2 (graphs
# on) against generate, continuous batching, its twin and itself eager.
# The older tiers follow what was unmeasured after the H200 session of
# 2026-11-27 (commits eac5868/eba1994; docs/benchmarks/reading/gpu.md):
# Tier 1 (about 7 minutes): the CUDA tests (the plain handler's batched
# decoding on CUDA failed there once; its fix has not run on a GPU); Ebird
# with batched nvJPEG decoding against NO Wait given the same execution
# (ebird_same) and against the stock systems (ebird); JPEG decode ways
# beside a launching model (the contended run has not finished in 60 s);
# Nimble against torch.compile on EfficientNet-B0 (measured: 1.62-2.26x).
# Tier 2 (about 9 minutes): DVABatch on BERT-base (9x below NO Wait's
# capacity on the H100, unchanged since); REEF workloads C and A, each with
# the split-SM variant (rt_sms: auto) and BE units as CUDA graphs
# (be_graphs) beside priority streams, neither run on a GPU yet (their tests
# run in tier 1's `tests`).
# Tier 3: Orca on GPT-2; Nimble on Inception-v3 and ResNet-50 again; the
# torch.compile fault beside Nimble's multi-stream capture (reproduced).
# The next GPU session starts with whatever tier is still unmeasured.
#
# Needs TorchServe's Python package `ts` importable (the handlers raise its
# PredictionException); where it is not installed, copy it without the
# frontend jar into .site/ (ignored by git; carry it) and this script puts
# .site on PYTHONPATH.  BENCH_COMMIT names the commit in the tables when the
# copy's .git is older than its tree.  Each step has its own time limit, so a
# slow step costs only itself; after every step the results so far are packed
# into OUT_DIR/results.tar (.md/.json/.png per benchmark, each step's log).
set -u
out=${1:?usage: bash bench/gpu_session.sh OUT_DIR TIER|STEP...}
shift
mkdir -p "$out"
work=$(mktemp -d)
export PYTHONPATH="$PWD/.site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}

tier0="new_cuda hostbound ebird_same hostbound_reef dvabatch orca"
tier1="tests ebird ebird_same jpeg nimble_effnet"
tier2="dvabatch reef_c reef_a"
tier3="orca nimble_inception nimble_resnet50 nimble_fault"
steps=" "
for arg in "${@:-1}"; do
    case $arg in
        0) steps+="$tier0 " ;;
        0a) steps+="new_cuda hostbound ebird_same " ;;
        0b) steps+="hostbound_reef dvabatch orca " ;;
        1) steps+="$tier1 " ;;
        2) steps+="$tier2 " ;;
        3) steps+="$tier3 " ;;
        all) steps+="$tier1 $tier2 $tier3 " ;;
        *) steps+="$arg " ;;
    esac
done

# DRY=1: every step on this machine's CPU with the shortest runs that still
# go through the same code, to find a script's bugs before the GPU's minutes.
if [[ ${DRY:-0} == 1 ]]; then
    dev=cpu secs=2 reps=1 cap=2 warm=1 limit_scale=6 batches=1,8 tests_k="graphs or padding or config"
else
    dev=cuda secs=5 reps=2 cap=4 warm=2 limit_scale=1 batches=1,8,32 tests_k="cuda or gpu or captured_multi_stream or weights_alive"
fi

pack() { tar -cf "$out/results.tar" -C "$work" . ; }
step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$(( $2 * limit_scale )); shift 2
    [[ $steps == *" $name "* ]] || return 0
    local started=$SECONDS
    echo "=== $name (limit ${limit}s): $*"
    timeout -k 10 "$limit" "$@" >"$work/$name.log" 2>&1
    local rc=$?
    tail -n 30 "$work/$name.log" | tr '\r' '\n' | grep -v '%|' | tail -n 22
    echo "=== $name: rc=$rc in $((SECONDS - started))s"
    pack
}

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  "$py" -c 'import torch, torchvision, platform; print("python", platform.python_version(), "torch", torch.__version__, "torchvision", torchvision.__version__, "cuda", torch.cuda.is_available())'
  echo "cores $(nproc)"; echo "commit ${BENCH_COMMIT:-$(git rev-parse --short HEAD)} (tree copied from it)"; } >"$work/machine.txt" 2>&1
cat "$work/machine.txt"
echo "steps:$steps"

# -- tier 0's own --------------------------------------------------------
# The CUDA code built since the last loan and never run on a GPU, first (a minute): REEF's split SMs (green
# contexts) and best-effort units as graphs, Orca's decode graphs.  Their benchmarks run later in the tiers.
step new_cuda 90 "$py" -m pytest -q -p no:cacheprovider -rs tests/gpu/test_reef_green_cuda.py \
    tests/gpu/test_reef_engine_cuda.py tests/gpu/test_orca_decode_graphs_cuda.py

# The host-bound regime (a one-layer BERT: each batch's compute in microseconds, the host's work per request
# decides): Ebird and DVABatch against NO Wait at the same largest batch, with host CPU per request by thread.
step hostbound 200 bash -c "for h in ebird dvabatch; do $py -m bench.ebird_direct --handler \$h --model bert-tiny1 \
    --device $dev --twin --max-batch 32 --fractions 0.3,0.85 --seconds $secs --repeats 1 --capacity-seconds $cap \
    --warmup-seconds $warm --suffix _hostbound --out-dir $work || exit 1; done"
# REEF's real-time path in the same regime (its answers encoded on the RT executor since 2026-11-30).
step hostbound_reef 120 "$py" -m bench.ebird_direct --handler reef --model bert-tiny1 --device "$dev" --twin \
    --max-batch 32 --fractions 0.3,0.85 --seconds "$secs" --repeats 1 --capacity-seconds "$cap" \
    --warmup-seconds "$warm" --suffix _hostbound --out-dir "$work"

# -- tier 1 ---------------------------------------------------------------
# Every test that skips without CUDA: tests/gpu, and the device-parametrized tests whose cuda case sits
# beside its cpu twin (the CPU-default tests of those two files run too).
step tests 150 "$py" -m pytest -q -p no:cacheprovider -rs \
    tests/gpu tests/unit/test_ebird_handler.py tests/unit/test_plain_handler_direct.py -k "$tests_k"

# Ebird (graphs) with JPEGs decoded in batches (nvJPEG) and as before (4 PIL threads) vs NO Wait and a 5 ms
# wait, and NO Wait's twin (A/A); the graphs-on-either-side comparison was measured on the H200.
step ebird 220 "$py" -m bench.ebird_direct --device "$dev" --wait-ms 5 --no-graphs-compare --twin \
    --ebird-decode-threads batched,auto \
    --fractions 0.3,0.85 --seconds "$secs" --repeats "$reps" --capacity-seconds "$cap" --warmup-seconds "$warm" \
    --out-dir "$work"
# How much of batched Ebird's lead is its scheduling: against NO Wait given the same execution (graphs
# replayed, each batch's JPEGs decoded in one nvJPEG call), with NO Wait's twin for the A/A band.
step ebird_same 200 "$py" -m bench.ebird_direct --device "$dev" --no-graphs-compare --same-execution --twin \
    --ebird-decode-threads batched --suffix _same_execution \
    --fractions 0.3,0.85 --seconds "$secs" --repeats "$reps" --capacity-seconds "$cap" --warmup-seconds "$warm" \
    --out-dir "$work"
# Where Ebird should decode JPEGs on a GPU server: PIL or torchvision on threads, or nvJPEG batched,
# alone and beside an eager ResNet-50 launching kernels from another thread (the GIL they share).
step jpeg 120 bash -c "$py -m bench.jpeg_decode --device $dev --images 512 --out-dir $work &&
    $py -m bench.jpeg_decode --device $dev --images 512 --contend --out-dir $work"

# Nimble (with its compiled candidate) vs torch.compile reduce-overhead, one model per step so that a slow
# compile costs only its own model (EfficientNet-B0 is the one not yet measured so).
step nimble_effnet 150 "$py" -m bench.nimble --device "$dev" --models efficientnet_b0 \
    --batches "$batches" --repeats 3 --runs 10 --suffix _efficientnet_b0 --out-dir "$work"

# -- tier 2 ---------------------------------------------------------------
# DVABatch vs NO Wait and a 10 ms wait: three loads, one repeat, a short capacity step (165 s on the H100).
step dvabatch 180 "$py" -m bench.ebird_direct --handler dvabatch --model bert-base --device "$dev" --wait-ms 10 \
    --fractions 0.25,0.6,0.9 --seconds "$secs" --repeats 1 --capacity-seconds 3 --warmup-seconds "$warm" \
    --out-dir "$work"

# REEF workloads C (six models in four handlers; 146 s on the H100) and A.
step reef_c 260 "$py" -m bench.reef_direct --device "$dev" --workload C --padding --green --graphs \
    --seconds $((secs + 3)) --repeats 1 --out-dir "$work"
step reef_a 220 "$py" -m bench.reef_direct --device "$dev" --workload A --padding --green --graphs \
    --seconds $((secs + 3)) --repeats "$reps" --out-dir "$work"

# -- tier 3 ---------------------------------------------------------------
# Orca against generate and transformers' continuous batching (the issue's two GPU rows), its twin beside.
step orca 200 "$py" -m bench.orca --device "$dev" --fractions 0.3,0.7 --seconds $((secs * 2)) \
    --capacity-seconds "$cap" --max-batches 16 --cuda-graphs --baselines generate,continuous,twin,eager \
    --out-dir "$work"
step nimble_inception 150 "$py" -m bench.nimble --device "$dev" --models inception_v3 \
    --batches "$batches" --repeats 3 --runs 10 --suffix _inception_v3 --out-dir "$work"
step nimble_resnet50 150 "$py" -m bench.nimble --device "$dev" --models resnet50 --batches "$batches" \
    --repeats 3 --runs 10 --suffix _resnet50 --out-dir "$work"
# torch.compile(mode="reduce-overhead") beside Nimble's captured graphs in one process: the fault seen on
# the H200 reproduced, or the same calls clean.
step nimble_fault 120 "$py" -m bench.nimble_compile_fault --device "$dev" --model resnet50 \
    --batches "$batches" --out-dir "$work"
pack
ls -la "$work"
