#!/usr/bin/env bash
# Everything issue-sized that needs a GPU, in one call on a bare GPU machine (one H100 here): the GPU tests (first),
# the efficiency table of every router and dense at LLaMA-185M (torch backend; Switch and DirMoE also on megatron's
# local backend; DirMoE eager beside compiled), and profiler traces of one Switch and one DirMoE step.
#
# From the repository root, with the wheels the machine lacks in .whl/ (megatron-core 0.16.1, omegaconf 2.4.0,
# zstandard; docs/efficiency.md says how to fetch them) and an output folder in OUT:
#   OUT=/tmp/out bash benchmarks/gpu_measure.sh
# PHASES (default "pytest efficiency trace"; also "repeat"; they run in the order pytest, efficiency, repeat,
# trace), EFF_ARGS, VARIANTS (space-separated --variant values; empty: none), REPEATS and REPEAT_ARGS (default 3 x
# "--router switch,dirmoe --iters 20"), TRACE_ARGS, PYTEST_ARGS and *_LIMIT (seconds per phase) select and shape the
# phases; BUDGET (default 560) is the seconds the whole call may take, install included: each phase's limit is cut
# to what is left, and a phase with under 30 s left is skipped and named in phases.txt, so a call fits the device
# tool's 600 s per command and still packs what it measured; PYTEST_WORKERS (default 3; a test holds up to two
# LLaMA-185M models with their optimizer states at once: 3 workers fitted an H100's 80 GB in two calls and ran out
# of it in a third, while the tests still kept every model they had trained). Writes OUT/h100.tgz (logs, run
# records, tables, trace summaries: what results/h100/ holds) after every phase, so a phase that runs out of time
# still leaves the others' results, and OUT/trace-<router>.json.gz. Works in a new folder (WORK, which must not
# exist, or a fresh temporary one), so an archive holds this call's files only, also on a machine that an earlier
# call left warm.
set -u
if [[ -n "${WORK:-}" ]]; then
  [[ -e "$WORK" ]] && { echo "gpu_measure.sh: WORK=$WORK exists: name a new folder" >&2; exit 2; }
  W=$WORK; mkdir -p "$W"
else
  W=$(mktemp -d /tmp/h100.XXXXXX)
fi
mkdir -p "$OUT"
: > "$W/phases.txt"
pack() { tar czf "$OUT/h100.tgz" --exclude='*.json.gz' --exclude='*.pt' -C "$W" . 2>/dev/null; }
PHASES=${PHASES:-pytest efficiency trace}
BUDGET=${BUDGET:-560}
phase() {  # phase NAME SECONDS COMMAND...: run with a time limit (cut to what BUDGET leaves), log to $W/NAME.log, pack
  local name=$1 limit=$2 start=$SECONDS rc left; shift 2
  [[ " $PHASES efficiency-table " == *" ${name%%[0-9]*} "* ]] || return 0  # repeat2 belongs to phase repeat
  left=$((BUDGET - SECONDS))
  if [[ $name != efficiency-table ]]; then  # (the table's cat takes no time)
    if ((left < 30)); then echo "$name skipped: $left s of BUDGET=$BUDGET left" | tee -a "$W/phases.txt"; return 0; fi
    ((limit > left)) && limit=$left
  fi
  echo "== $name (limit ${limit} s) $(date +%T)"
  timeout --signal=INT --kill-after=15 "$limit" "$@" > "$W/$name.log" 2>&1; rc=$?
  echo "$name rc=$rc $((SECONDS - start)) s" | tee -a "$W/phases.txt"
  tail -n "${TAIL:-4}" "$W/$name.log"
  pack
}
export PYTHONUNBUFFERED=1 HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}
if ! $PY -c "import megatron.core, omegaconf, zstandard" 2>/dev/null; then  # a bare machine: install the wheels
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
{ date -u +%FT%TZ; git rev-parse HEAD 2>/dev/null; echo "boot id $(cat /proc/sys/kernel/random/boot_id)"; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv;
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

# The checks first: a timing of wrong results is worth nothing, and a call that runs out of time keeps them.
set -f  # PYTEST_ARGS may hold test ids with brackets
TAIL=12 phase pytest "${PYTEST_LIMIT:-200}" $PY -m pytest -m gpu -q -p no:cacheprovider \
  -n "${PYTEST_WORKERS:-3}" --dist load --durations=0 -rs ${PYTEST_ARGS:-tests/test_gpu.py}
set +f

EFF=${EFF_ARGS:---published --iters 10}
VARIANTS=${VARIANTS-dirmoe-eager=dirmoe,router.options.compile_elementwise=never switch-local=switch,model.backend=local dirmoe-local=dirmoe,model.backend=local}
VARIANT_ARGS=(); for v in $VARIANTS; do VARIANT_ARGS+=(--variant "$v"); done
phase efficiency "${EFF_LIMIT:-330}" $PY -m repro efficiency $EFF "${VARIANT_ARGS[@]}" --out "$W/efficiency"
TAIL=16 phase efficiency-table 5 cat "$W/efficiency/efficiency.md"
# Repeats (phase "repeat"): the same routers again and again, alternating within each command, so their ratio
# comes with its spread over runs (REPEATS commands; gpu_collect.py pairs the runs of each).
for i in $(seq 1 "${REPEATS:-3}"); do
  phase "repeat$i" "${REPEAT_LIMIT:-150}" $PY -m repro efficiency ${REPEAT_ARGS:---router switch,dirmoe --iters 20} \
    --out "$W/repeat$i"
done
phase trace "${TRACE_LIMIT:-120}" $PY -m repro efficiency --router switch,dirmoe --warmup 3 --iters 2 \
  --set logging.trace_step=5 ${TRACE_ARGS:-} --out "$W/trace"
for r in switch dirmoe; do cp "$W/trace/runs/$r/trace/trace.json.gz" "$OUT/trace-$r.json.gz" 2>/dev/null; done
cat "$W/phases.txt"
