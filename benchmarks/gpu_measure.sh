#!/usr/bin/env bash
# Everything issue-sized that needs a GPU, in one call of at most 600 s on a bare GPU machine (one H100 or H200):
#
#   pytest     the GPU tests, first: a timing of wrong results is worth nothing, and a call cut short keeps them;
#   interleave Switch and DirMoE at LLaMA-185M stepped in turn in one process (python -m repro study efficiency's
#              default on one device): the ratio with its 95% interval, each router's step traced once
#              (device busy against the step's span, the routers' kernels and device time);
#   levers     Switch with each lever of the device-bound step (micro-batch 32 x 2, foreach optimizer
#              fallbacks, fused linear + cross-entropy) and with all of them, DirMoE with all of them, stepped in
#              turn with plain Switch: each lever's gain with its interval;
#   routers    (not by default) every router and dense, stepped in turn.
#
# From the repository root, with the wheels the machine lacks in .whl/ (docs/efficiency.md, "Efficiency on any number of GPUs",
# says which and how to fetch them) and an output folder in OUT:
#   OUT=/tmp/out bash benchmarks/gpu_measure.sh
# PHASES (default "pytest interleave levers") selects phases, which run in the order above; *_ARGS reshape them;
# *_LIMIT are seconds per phase. BUDGET (default 560) is the seconds the whole call may take, install included:
# each phase's limit is cut to what is left and a phase with under 30 s left is skipped and named in phases.txt.
# PYTEST_WORKERS (default 2) runs the GPU tests in that many processes (each holds up to two LLaMA-185M models).
# Writes OUT/gpu.tgz after every phase (logs, run directories without checkpoints, tables, summaries, trace
# summaries; each phase's folder is its efficiency command's own output, summary.json with the ratios included),
# so a phase cut short still leaves the others' results, and
# the traced steps' Chrome traces as OUT/trace-<phase>-<run>.json.gz. Works in a new folder (WORK, which must not
# exist, or a fresh temporary one), so an archive holds this call's files only.
set -u
if [[ -n "${WORK:-}" ]]; then
  [[ -e "$WORK" ]] && { echo "gpu_measure.sh: WORK=$WORK exists: name a new folder" >&2; exit 2; }
  W=$WORK; mkdir -p "$W"
else
  W=$(mktemp -d /tmp/gpu.XXXXXX)
fi
mkdir -p "$OUT"
: > "$W/phases.txt"
pack() { tar czf "$OUT/gpu.tgz" --exclude='*.json.gz' --exclude='*.pt' --exclude='checkpoints' -C "$W" . 2>/dev/null; }
PHASES=${PHASES:-pytest interleave levers}
BUDGET=${BUDGET:-560}
phase() {  # phase NAME SECONDS COMMAND...: run with a time limit (cut to what BUDGET leaves), log to $W/NAME.log, pack
  local name=$1 limit=$2 start=$SECONDS rc left; shift 2
  [[ " $PHASES " == *" $name "* ]] || return 0
  left=$((BUDGET - SECONDS))
  if ((left < 30)); then echo "$name skipped: $left s of BUDGET=$BUDGET left" | tee -a "$W/phases.txt"; return 0; fi
  ((limit > left)) && limit=$left
  echo "== $name (limit ${limit} s) $(date +%T)"
  # SIGINT first: an interleaved efficiency phase stops after its round and reports the rounds done (summary.json)
  timeout --signal=INT --kill-after=15 "$limit" "$@" > "$W/$name.log" 2>&1; rc=$?
  echo "$name rc=$rc $((SECONDS - start)) s" | tee -a "$W/phases.txt"
  tail -n "${TAIL:-6}" "$W/$name.log"
  pack
}
export PYTHONUNBUFFERED=1 HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}
if ! $PY -c "import megatron.core, omegaconf, zstandard" 2>/dev/null; then  # a bare machine (cut-cross-entropy with them)
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
{ date -u +%FT%TZ; git rev-parse HEAD 2>/dev/null; git status --porcelain 2>/dev/null | head -20;
  echo "boot id $(cat /proc/sys/kernel/random/boot_id)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  $PY - <<'PY'
import shutil, sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)
import megatron.core, triton
print("megatron-core", megatron.core.__version__, "triton", triton.__version__, "cc", shutil.which("cc") or shutil.which("gcc"))
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, "sm", f"{p.major}{p.minor}", "SMs", p.multi_processor_count, "mem GiB", round(p.total_memory / 2**30, 1))
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16); b = torch.randn_like(a)
    for _ in range(3): a @ b
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(); s.record()
    for _ in range(20): a @ b
    e.record(); torch.cuda.synchronize()
    print(f"bf16 matmul 8192^3: {2 * 8192**3 * 20 / (s.elapsed_time(e) / 1e3) / 1e12:.0f} TFLOP/s (mean of 20, random data)")
PY
} > "$W/environment.txt" 2>&1
cat "$W/environment.txt"
pack

set -f  # PYTEST_ARGS may hold test ids with brackets
TAIL=14 phase pytest "${PYTEST_LIMIT:-170}" $PY -m pytest -m gpu -q -p no:cacheprovider \
  -n "${PYTEST_WORKERS:-2}" --dist load --durations=15 -rs ${PYTEST_ARGS:-tests/test_gpu.py tests/test_gpu_levers.py}
set +f

# The last warm-up step is traced (its own step only: repro/training/interleave.py), so no measured step is slowed.
EFF="$PY -m repro study efficiency"
phase interleave "${INTERLEAVE_LIMIT:-210}" $EFF ${INTERLEAVE_ARGS:---router switch,dirmoe --warmup 20 --iters 150 \
  --set logging.trace_step=20} --out "$W/interleave"
# Without cut-cross-entropy's wheel the fused loss lever is measured by torch.compile (the study refuses cce then).
CCE=cce
if [[ " $PHASES " == *" levers "* ]] && ! $PY -c "import cut_cross_entropy" 2>/dev/null; then
  CCE=torch_compile; echo "levers: no cut-cross-entropy: fused CE by torch_compile" | tee -a "$W/phases.txt"
fi
ALL="data.micro_batch_size=32,optimizer.foreach_fallbacks=true,model.fused_cross_entropy=$CCE"
phase levers "${LEVERS_LIMIT:-200}" $EFF ${LEVERS_ARGS:---router switch --warmup 8 --iters 30 \
  --set logging.trace_step=8 --variant switch-mb32=switch,data.micro_batch_size=32 \
  --variant switch-foreach=switch,optimizer.foreach_fallbacks=true \
  --variant switch-cce=switch,model.fused_cross_entropy=$CCE \
  --variant switch-all=switch,$ALL --variant dirmoe-all=dirmoe,$ALL} --out "$W/levers"
phase routers "${ROUTERS_LIMIT:-300}" $EFF ${ROUTERS_ARGS:---router all --warmup 5 --iters 20} --out "$W/routers"
n=0
for f in "$W"/*/runs/*/trace/trace.json.gz; do
  [[ -e $f ]] || continue
  run=$(basename "$(dirname "$(dirname "$f")")"); ph=$(basename "$(dirname "$(dirname "$(dirname "$(dirname "$f")")")")")
  ((n < 7)) && cp "$f" "$OUT/trace-$ph-$run.json.gz" && n=$((n + 1))
done
cat "$W/phases.txt"
