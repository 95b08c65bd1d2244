#!/usr/bin/env bash
# The prepared paper-scale runs (issue #44 item 4), for a lent GPU: what fits in one command's
# budget, resumably. Never part of CI: no test and no make target runs it.
#
#   bash bench/gpu_papers.sh [OUT]          # default OUT: bench-out/gpu-papers
#   GPU_PAPERS_BUDGET=540                   # seconds this command may train (under a lease's 10 min)
#   GPU_PAPERS_DEVICE=cuda                  # cpu with GPU_PAPERS_SMOKE=1: a tiny CPU rehearsal
#   GPU_PAPERS_WORK=runs/gpu-papers         # the runs; must survive between commands to resume
#   FEDATTN_DATA=.gpudata                   # mnist/ and cifar-10/cifar-10-batches-bin/ (see below)
#   GPU_PAPERS_SEEDS="0 1 2"                # the seeds, in order
#
# Rows, in this order, seed 0 of every row before seed 1 of any (each step resumes its runs
# from their last round checkpoint and is skipped once finished):
#   1 FedSTAR at the paper's schedule on MNIST (Fashion-MNIST is not available): FedProto, the
#     attention-only ablation, FedSTAR; 100 clients, 30 % per round, 200 rounds x 5 epochs,
#     SGD lr 0.005, batch 8192, native 28 px (bench/fedstar.py --full);
#   2 the Fed-SAP Table IV core set: CIFAR-10, all 50,000 images, 10 clients, Dirichlet 0.5,
#     MobileNetV3-Small, 50 rounds; Local, FedAvg, FedProx, FedBN, FedPer, pSE alone, Fed-SAP
#     (bench/fedsap.py --full, the 7 federations at once);
#   3 pFedKA and FedAvg: ResNet-18, 100 clients, 10 per round, alpha 0.1, 100 rounds
#     (bench/pfedka.py --full);
#   then seeds 1 and 2 of each.
# Each bench stops its runs at the budget left (--budget-seconds; exit 3) and the next
# command resumes them. Runs resume only where GPU_PAPERS_WORK survives: on the same warm
# machine (a lease keeps ignored folders between calls). Data: MNIST (12 MB) travels in one
# call; CIFAR-10's 154 MB does not fit a call's 64 MiB, so it is carried in pieces into the
# same ignored folder over back-to-back calls (docs/benchmarks.md, "Paper-scale rows on a GPU").
# Under $OUT: 00-gpu.txt, gpu-papers.log (every bench's output), progress.txt (every run:
# rounds done, last accuracy, seconds per round).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench-out/gpu-papers}
WORK=${GPU_PAPERS_WORK:-runs/gpu-papers}
BUDGET=${GPU_PAPERS_BUDGET:-540}
DEVICE=${GPU_PAPERS_DEVICE:-cuda}
PY=${PYTHON:-python}
export FEDATTN_DATA=${FEDATTN_DATA:-$PWD/.gpudata}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT" "$WORK"
LOG="$OUT/gpu-papers.log"
START=$SECONDS

if [ -n "${GPU_PAPERS_SMOKE:-}" ]; then  # the same steps at toy scale (a CPU rehearsal)
    FEDSTAR=(--limit 400 --edges 4 --fraction 1 --rounds 2 --epochs 1 --eval-every 1
             --min-per-edge 10 --global-test 5 --batch-size 64 --procs 1)
    FEDSAP=(--limit 400 --edges 2 --rounds 2 --eval-every 1 --procs 1)
    PFEDKA=(--limit 400 --edges 4 --fraction 0.5 --rounds 2 --eval-every 1
            --procs 1)
else
    FEDSTAR=(--full)
    FEDSAP=(--full --jobs 7)
    PFEDKA=(--full)
fi

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 || echo "no nvidia-smi"
  $PY -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name(0))" 2>&1
  echo "device $DEVICE, budget $BUDGET s, data $FEDATTN_DATA, runs $WORK"; } > "$OUT/00-gpu.txt" 2>&1
cat "$OUT/00-gpu.txt"

have() { [ -e "$FEDATTN_DATA/$1" ] || { echo "== $2: skipped, $FEDATTN_DATA/$1 is missing" | tee -a "$LOG"; return 1; }; }

# bench NAME SCRIPT ARGS...: runs one bench with the budget left; 0 done, 3 budget spent.
bench() {
    local name=$1; shift
    local left=$((BUDGET - (SECONDS - START)))
    if [ "$left" -lt 30 ]; then
        echo "== $name: no budget left" | tee -a "$LOG"
        return 3
    fi
    echo "== $name ($left s left)" | tee -a "$LOG"
    "$PY" "$@" --device "$DEVICE" --budget-seconds "$left" >> "$LOG" 2>&1
    local rc=$?
    tail -n 25 "$LOG"
    return $rc
}

status=0
for seed in ${GPU_PAPERS_SEEDS:-0 1 2}; do
    if have mnist "fedstar s$seed"; then
        bench "fedstar s$seed" bench/fedstar.py "${FEDSTAR[@]}" --datasets mnist \
            --methods fedproto ablation fedstar --seeds "$seed" --out "$WORK/fedstar"
        status=$?; [ "$status" -eq 0 ] || break
    fi
    if have cifar-10/cifar-10-batches-bin/data_batch_5.bin "fedsap s$seed"; then
        bench "fedsap s$seed" bench/fedsap.py "${FEDSAP[@]}" --what table --seeds "$seed" \
            --only local fedavg fedprox fedbn fedper pse-only fedsap --out "$WORK/fedsap"
        status=$?; [ "$status" -eq 0 ] || break
        bench "pfedka s$seed" bench/pfedka.py "${PFEDKA[@]}" --what table --only fedavg \
            --alphas 0.1 --seeds "$seed" --out "$WORK/pfedka"
        status=$?; [ "$status" -eq 0 ] || break
    fi
done

# Every run's progress, finished or not (history.json is rewritten after every round).
"$PY" - "$WORK" > "$OUT/progress.txt" <<'EOF'
import json, statistics, sys
from pathlib import Path

for history in sorted(Path(sys.argv[1]).glob("*/runs/**/server/history.json")):
    try:
        data = json.loads(history.read_text())
    except ValueError:
        continue
    rounds = data["rounds"]
    scored = [r for r in rounds if r.get("evaluation", {}).get("summary", {}).get("test")]
    last = scored[-1]["evaluation"]["summary"]["test"]["mean_accuracy"] if scored else float("nan")
    per_round = statistics.mean(r["seconds"] for r in rounds) if rounds else float("nan")
    print(f"{history.parent.parent.relative_to(sys.argv[1])}: {len(rounds)} rounds done, "
          f"mean local-test accuracy {last:.4f} at round {scored[-1]['round'] if scored else '-'}, "
          f"{per_round:.1f} s per round")
EOF
cat "$OUT/progress.txt"
case $status in
    0) echo "gpu_papers: every step done or skipped for want of data; results in $OUT" ;;
    3) echo "gpu_papers: budget spent; run the same command again (on the same machine) to resume"
       exit 3 ;;
    *) echo "gpu_papers: a step failed ($status); see $LOG"; exit 1 ;;
esac
