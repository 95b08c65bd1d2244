#!/usr/bin/env bash
# The prepared GPU check (issue #39): everything about the edge on a GPU that a CPU cannot
# show, in one command, under 9 minutes on one GPU. Resumable: each step writes its result
# file under OUT and is skipped when that file is there (a step's output is written to a
# .part file and moved in place only when the step succeeded), so a lent GPU that goes
# away mid-way loses only the step it was in.
#
#   bash bench/gpu_check.sh [OUT]                 # default OUT: bench-out/gpu-check
#   GPU_CHECK_DEVICE=cpu GPU_CHECK_SMOKE=1 bash bench/gpu_check.sh OUT   # the suite's smoke run
#
# Steps: 01 tests/test_cuda.py; 02-04 bench/edge_throughput.py (fl-edge's loop / a bare
# loop, images/s and CPU time) for MobileNetV3-Small and ResNet-18 without determinism,
# with train.deterministic (strict on CUDA), and with autocast; 05 a DP-SGD step's peak GPU
# memory at batch 32 and 64; 06-07 two same-seed CUDA runs compared bit for bit, strict and
# warn-only. Then the figures go to docs/benchmarks.md by hand, with the card's name.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench-out/gpu-check}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
PY=${PYTHON:-python}
mkdir -p "$OUT"
if [ -n "${GPU_CHECK_SMOKE:-}" ]; then
    MODELS="lenet-bn"; DP_MODELS="lenet-bn+gn"; SIDE=28; IMAGES=32; REPS=1; BATCHES="4"
    SEED_MODELS="lenet-bn se-cnn"
    DATA_ON="host"; LIMIT=300
else
    MODELS="mobilenet-v3-small resnet18-cifar"; DP_MODELS="mobilenet-v3-small+gn resnet18-cifar+gn"
    SIDE=32; IMAGES=4096; REPS=3; BATCHES="32 64"; DATA_ON="host device"; LIMIT=150
    SEED_MODELS="$MODELS se-cnn alexnet-bn"
fi
failed=0

# step NAME FILE COMMAND...: runs COMMAND unless OUT/FILE exists; its output (stdout and
# stderr) goes to OUT/NAME.log; FILE is the result file the command writes (via .part).
step() {
    local name=$1 file=$2; shift 2
    if [ -e "$OUT/$file" ]; then
        echo "== $name: done before ($OUT/$file)"
        return 0
    fi
    echo "== $name"
    local start=$SECONDS
    if timeout "$LIMIT" "$@" > "$OUT/$name.log" 2>&1 && [ -e "$OUT/$file.part" ]; then
        mv "$OUT/$file.part" "$OUT/$file"
        tail -n 8 "$OUT/$name.log"
        echo "   ($((SECONDS - start)) s)"
    else
        echo "   FAILED after $((SECONDS - start)) s; see $OUT/$name.log"
        tail -n 20 "$OUT/$name.log"
        failed=1
    fi
}

# The throughput bench's common arguments (a command for `timeout`, so not a function).
# shellcheck disable=SC2206
THROUGHPUT=("$PY" bench/edge_throughput.py --device "$DEVICE" --models $MODELS --image-size "$SIDE"
            --images "$IMAGES" --batch-size 64 --reps "$REPS" --data-on $DATA_ON)

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/00-gpu.txt" 2>&1 \
    || echo "no nvidia-smi" > "$OUT/00-gpu.txt"
$PY -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name(0))" \
    >> "$OUT/00-gpu.txt" 2>&1

# shellcheck disable=SC2016
step 01-test_cuda 01-test_cuda.txt bash -c \
    "$PY -m pytest -q -p no:cacheprovider tests/test_cuda.py > '$OUT/01-test_cuda.txt.part' 2>&1; \
     rc=\$?; cat '$OUT/01-test_cuda.txt.part'; [ \$rc -eq 0 ] || [ \$rc -eq 5 ]"
step 02-throughput 02-throughput.json "${THROUGHPUT[@]}" --json "$OUT/02-throughput.json.part"
step 03-throughput-deterministic 03-throughput-deterministic.json "${THROUGHPUT[@]}" \
    --deterministic --json "$OUT/03-throughput-deterministic.json.part"
step 04-throughput-amp 04-throughput-amp.json "${THROUGHPUT[@]}" --amp \
    --json "$OUT/04-throughput-amp.json.part"
# shellcheck disable=SC2086
step 05-dp-memory 05-dp-memory.json $PY bench/gpu_check_steps.py dp-memory --device "$DEVICE" \
    --models $DP_MODELS --batch $BATCHES --side "$SIDE" --json "$OUT/05-dp-memory.json.part"
# shellcheck disable=SC2086
step 06-same-seed 06-same-seed.json $PY bench/gpu_check_steps.py same-seed --device "$DEVICE" \
    --models $SEED_MODELS --side "$SIDE" --json "$OUT/06-same-seed.json.part"
# shellcheck disable=SC2086
step 07-same-seed-warn-only 07-same-seed-warn-only.json $PY bench/gpu_check_steps.py same-seed \
    --device "$DEVICE" --models $SEED_MODELS --side "$SIDE" --warn-only \
    --json "$OUT/07-same-seed-warn-only.json.part"

if [ "$failed" -ne 0 ]; then
    echo "gpu_check: some steps failed; run again to retry only those"
    exit 1
fi
echo "gpu_check: all steps done; results in $OUT"
