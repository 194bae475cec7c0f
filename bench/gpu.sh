#!/usr/bin/env bash
# GPU checks for a lent GPU machine, in two halves.
#
#   bash bench/gpu.sh prepare   HERE (with network): download the wheels the GPU machine
#                               lacks (Python 3.12, manylinux x86-64) into .gpu-wheels/
#                               (git-ignored), pinned to the versions in .venv.
#   bash bench/gpu.sh run       ON THE GPU MACHINE (no network): install those wheels
#                               offline, build the "large" tiny model, run the checks.
#   bash bench/gpu.sh families  ON THE GPU MACHINE, a second call: the same install, then
#                               each model family beyond Flux (FAMILIES below): its
#                               parallel math on CUDA, one rank at the GPU's size (Qwen-Image
#                               at its real width), its NCCL layouts with >= 2 GPUs.
#
# Through the device tool: prepare first, then one call
#   run(command="bash bench/gpu.sh run", carry=[".gpu-wheels"], timeout_s=560)
# It keeps itself under DPSERVE_GPU_BUDGET_S (default 480 s) with a `timeout` on every
# step, runs unattended, and writes every figure under $OUT (the tool's output folder):
#   summary.txt     what it printed last (also its stdout)
#   env.txt         nvidia-smi, python, torch, GPU count
#   steps.txt       each step's exit status and seconds
#   build.json      time and size of the model build
#   single.json     one rank at 1024x1024 bf16: latency, peak memory, same-seed PNG digests
#   dp_pair.json    two replicas on GPU 0: a concurrent pair vs one request (pair_ratio)
#   parallel_modes.txt  (>= 2 GPUs) each NCCL layout's speed-up and per-rank memory
#   parallel_math.txt   sp/tp code paths on CUDA tensors as co-located ranks (pytest)
#   step_cache.txt  bench/step_cache.py: each step cache's speed-up and PSNR vs uncached
#   compile.txt     bench/compile.py: --compile vs eager after warm-up, first request's ratio
#   logs/*.log      every step's full output
#
# Environment (for a CPU dry run of the run half, and for odd machines):
#   DPSERVE_GPU_DRYRUN=1   --device cpu, float32, the tiny variant, 128 px, 2 steps
#   DPSERVE_GPU_COUNT=N    pretend N GPUs (which branch of the parallel check runs)
#   GPU_PYTHON             the interpreter that has torch (default: python3)
#   GPU_WHEELS             the wheel folder (default: .gpu-wheels in the repo)
#   GPU_PY_VERSION         prepare: the target Python (default 3.12)
#   DPSERVE_GPU_STATE      run: scratch for the venv and the 5 GB model (default /tmp/dpserve-gpu)
set -uo pipefail

SELF=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")
ROOT=$(dirname "$(dirname "$SELF")")
WHEELS=${GPU_WHEELS:-$ROOT/.gpu-wheels}
STEPS_PY=$ROOT/bench/gpu_steps.py

prepare() {
  set -e
  local py=${PREPARE_PYTHON:-$ROOT/.venv/bin/python} version=${GPU_PY_VERSION:-3.12}
  local pins
  pins=$("$py" "$STEPS_PY" pins --python-version "$version")
  mkdir -p "$WHEELS"
  rm -f "$WHEELS"/*.whl
  # shellcheck disable=SC2086  # one argument per pin
  "$py" -m pip download --quiet --dest "$WHEELS" --no-deps --only-binary=:all: \
    --implementation cp --python-version "$version" --abi "cp${version/./}" --abi abi3 \
    --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any $pins
  local n size
  n=$(find "$WHEELS" -name '*.whl' | wc -l)
  size=$(du -sm "$WHEELS" | cut -f1)
  echo "prepare: $n wheels for Python $version in $WHEELS ($size MiB; the device tool carries 64 MiB)"
  if ((size >= 56)); then
    echo "prepare: too big to carry" >&2
    return 1
  fi
}

# ------------------------------------------------------------------------------ run half

log() { echo "$*" | tee -a "$OUT/summary.txt"; }

# step NAME LIMIT_S CMD...: run CMD under timeout (bounded by what is left of the budget),
# its output in logs/NAME.log; records rc and seconds in steps.txt. A CMD that is a
# function of this script runs as `bash gpu.sh _CMD ...` (timeout runs programs only).
step() {
  local name=$1 limit=$2
  shift 2
  local left=$((BUDGET - (SECONDS - START)))
  if ((left < 15)); then
    echo "$name skipped (budget spent)" >>"$OUT/steps.txt"
    log "$name: skipped, the ${BUDGET}s budget is spent"
    return 124
  fi
  ((limit > left)) && limit=$left
  local t0=$SECONDS rc=0
  if declare -F "$1" >/dev/null; then
    set -- bash "$SELF" "_$1" "${@:2}"
  fi
  timeout -k 10 "$limit" "$@" >"$OUT/logs/$name.log" 2>&1 || rc=$?
  echo "$name rc=$rc ${limit}s-limit $((SECONDS - t0))s" >>"$OUT/steps.txt"
  ((rc == 124 || rc == 137)) && log "$name: timed out after ${limit}s (logs/$name.log)"
  return $rc
}

# A virtual environment that sees every site-packages folder of $1 (system or venv alike:
# venv's own --system-site-packages would miss a venv's), so pip installs only what is
# missing or too old there, and shadows nothing else. Without a pip of its own when $1 has
# one (its pip then installs into the venv): a venv's bundled setuptools (3.11) would
# shadow the newer one that torch requires.
make_env() {
  local base=$1 venv=$2
  rm -rf "$venv"
  if "$base" -m pip --version >/dev/null 2>&1; then
    "$base" -m venv --without-pip "$venv" || return 1
  else
    "$base" -m venv "$venv" || return 1
  fi
  local site
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
  "$base" - "$site/_dpserve_base_site.pth" <<'EOF'
import sys
dirs = [p for p in sys.path if p.rstrip("/").endswith(("site-packages", "dist-packages"))]
with open(sys.argv[1], "w") as f:
    f.write("import site; " + "; ".join(f"site.addsitedir({d!r})" for d in dirs) + "\n")
EOF
}

install() {
  local base=$1 venv=$2
  local -a roots
  mapfile -t roots < <("$base" "$STEPS_PY" roots)
  local pip=(-m pip install --no-index --find-links "$WHEELS" --disable-pip-version-check)
  if make_env "$base" "$venv"; then
    "$venv/bin/python" "${pip[@]}" "${roots[@]}" && return 0
    echo "install: resolving failed; installing every missing distribution without dependencies"
    local -a wheels
    mapfile -t wheels < <("$venv/bin/python" "$STEPS_PY" missing "$WHEELS")
    ((${#wheels[@]} == 0)) && return 0
    "$venv/bin/python" "${pip[@]}" --no-deps "${wheels[@]}" && return 0
  fi
  echo "install: no venv or pip; unpacking the missing wheels into $STATE/site"
  "$base" "$STEPS_PY" extract "$WHEELS" "$STATE/site" || return 1
  return 3 # tells run() to use $base with PYTHONPATH
}

build_model() {
  local t0=$SECONDS
  rm -rf "$MODEL"
  # The CLI once knew only tiny/small; the builder itself knows every variant.
  "$PY" -m dpserve make-tiny-model "$MODEL" --variant "$VARIANT" ||
    "$PY" -c 'import sys; from pathlib import Path
from dpserve.worker.tiny_model import build_tiny_pipeline
print(build_tiny_pipeline(Path(sys.argv[1]), variant=sys.argv[2]))' "$MODEL" "$VARIANT" ||
    return 1
  local mb
  mb=$(du -sm "$MODEL" | cut -f1)
  printf '{"variant": "%s", "build_s": %d, "size_mb": %d}\n' "$VARIANT" $((SECONDS - t0)) "$mb" \
    >"$OUT/build.json"
}

# The machine, the wheels and the imports, shared by run and families; sets PY, device,
# dtype, size, steps, tokens and gpus (dynamic scope: the callers' locals).
setup() {
  OUT=${OUT:-$(mktemp -d)}
  mkdir -p "$OUT/logs"
  : >"$OUT/summary.txt"
  : >"$OUT/steps.txt"
  START=$SECONDS
  BUDGET=${DPSERVE_GPU_BUDGET_S:-480}
  STATE=${DPSERVE_GPU_STATE:-${TMPDIR:-/tmp}/dpserve-gpu}
  mkdir -p "$STATE"
  local base=${GPU_PYTHON:-python3}
  export OUT STATE MODEL VARIANT PY WHEELS
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 PIP_NO_INDEX=1
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  device=cuda dtype=bfloat16 size=1024 steps=4 tokens=""
  VARIANT=large
  if [[ ${DPSERVE_GPU_DRYRUN:-0} == 1 ]]; then
    device=cpu dtype=float32 size=128 steps=2 tokens=64 VARIANT=tiny
    log "DRY RUN on CPU: tiny variant, float32, ${size}px, $steps steps"
  fi
  MODEL=$STATE/model-$VARIANT

  step env 30 bash -c "nvidia-smi; nvidia-smi -L; '$base' -VV; '$base' -c 'import torch, sys
print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"gpus\", torch.cuda.device_count())
for i in range(torch.cuda.device_count()): print(i, torch.cuda.get_device_name(i))'"
  cp "$OUT/logs/env.log" "$OUT/env.txt"
  gpus=${DPSERVE_GPU_COUNT:-$(sed -n 's/^torch .* gpus \([0-9]*\)$/\1/p' "$OUT/env.txt")}
  gpus=${gpus:-0}
  log "machine: $(grep -m1 '^torch ' "$OUT/env.txt" || echo 'torch: not importable')"

  rc=0
  step install 120 install "$base" "$STATE/venv" || rc=$?
  PY=$STATE/venv/bin/python
  if ((rc == 3)); then
    PY=$base
    export PYTHONPATH="$PYTHONPATH:$STATE/site"
  elif ((rc != 0)); then
    log "install: failed (rc=$rc, logs/install.log)"
  fi
  if ! step imports 60 "$PY" -c 'import diffusers, msgspec, peft, PIL, psutil, zmq, torch
import dpserve.local, dpserve.worker.pipeline
print("diffusers", diffusers.__version__, "torch", torch.__version__)'; then
    log "imports: failed (logs/imports.log); nothing else can run"
    tail -n 5 "$OUT/logs/imports.log" | tee -a "$OUT/summary.txt"
    return 1
  fi
  log "install: ok ($(tail -n 1 "$OUT/logs/imports.log"))"
}

run() {
  local device dtype size steps tokens gpus rc=0
  setup || return 1

  if step build 150 build_model; then
    log "build: $(cat "$OUT/build.json")"
  else
    log "build: failed (logs/build.log)"
    return 1
  fi

  step serve_checks 200 "$PY" "$STEPS_PY" serve-checks --model "$MODEL" --out "$OUT" \
    --device "$device" --dtype "$dtype" --size "$size" --steps "$steps" \
    ${tokens:+--max-sequence-length "$tokens"} ||
    log "serve_checks: failed (logs/serve_checks.log)"
  grep -E '^(single|determinism|dp=2)' "$OUT/logs/serve_checks.log" | tee -a "$OUT/summary.txt"

  if ((gpus >= 2)) || [[ $device == cpu && ${DPSERVE_GPU_COUNT:-0} -ge 2 ]]; then
    local -a pm=(--model "$MODEL" --variant "$VARIANT" --device "$device" --dtype "$dtype")
    pm+=(--size "$size" --steps "$steps" --rounds 3 --max-foreign 64)
    [[ -n $tokens ]] && pm+=(--max-sequence-length "$tokens")
    # Its figures (stdout) to parallel_modes.txt, the workers' logs to logs/.
    # shellcheck disable=SC2016  # $@ and $OUT expand in the inner shell
    step parallel_modes 240 bash -c 'exec "$@" >"$OUT/parallel_modes.txt"' _ \
      "$PY" "$ROOT/bench/parallel_modes.py" "${pm[@]}" ||
      log "parallel_modes: failed (logs/parallel_modes.log)"
    log "parallel layouts ($gpus GPUs, NCCL):"
    tail -n 8 "$OUT/parallel_modes.txt" | tee -a "$OUT/summary.txt"
  else
    log "parallel layouts: $gpus GPU(s); NCCL needs one GPU per rank, so only the math check"
  fi

  local math=$ROOT/tests/integration/test_parallel_math.py
  if [[ -f $math ]]; then
    rc=0
    (cd "$ROOT" && DPSERVE_TEST_DEVICE=$device step parallel_math 240 \
      "$PY" -m pytest "$math" -q -x -p no:cacheprovider) || rc=$?
    cp "$OUT/logs/parallel_math.log" "$OUT/parallel_math.txt"
    log "parallel math on $device (co-located ranks): rc=$rc;" \
      "$(grep -v '^[[:space:]]*$' "$OUT/parallel_math.txt" | tail -n 1)"
  else
    log "parallel math: tests/integration/test_parallel_math.py is missing"
  fi
  # Step caches and compile on one GPU (bench/step_cache.py, bench/compile.py): the same
  # benchmarks as on a CPU, at the GPU's size in bfloat16; their figure lines last.
  local -a accel=(--model "$MODEL" --device "$device" --dtype "$dtype" --size "$size")
  [[ -n $tokens ]] && accel+=(--max-sequence-length "$tokens")
  local cache_steps=20
  [[ ${DPSERVE_GPU_DRYRUN:-0} == 1 ]] && cache_steps=8
  # shellcheck disable=SC2016  # $@ and $OUT expand in the inner shell
  step step_cache 150 bash -c 'exec "$@" >"$OUT/step_cache.txt"' _ \
    "$PY" "$ROOT/bench/step_cache.py" "${accel[@]}" --steps "$cache_steps" --rounds 2 ||
    log "step_cache: failed (logs/step_cache.log)"
  log "step caches: $(tail -n 1 "$OUT/step_cache.txt" 2>/dev/null)"
  # shellcheck disable=SC2016
  step compile 200 bash -c 'exec "$@" >"$OUT/compile.txt"' _ \
    "$PY" "$ROOT/bench/compile.py" "${accel[@]}" --steps "$cache_steps" --rounds 3 ||
    log "compile: failed (logs/compile.log)"
  log "compile: $(tail -n 1 "$OUT/compile.txt" 2>/dev/null)"
  log "total: $((SECONDS - START))s of ${BUDGET}s budget; steps: $(tr '\n' ';' <"$OUT/steps.txt")"
}


# Each model family beyond Flux (docs/worker.md, Adding a model family), on one GPU: its
# parallel math on CUDA tensors (co-located ranks over gloo), one rank's latency and peak
# memory through the worker at the GPU's size, and with >= 2 GPUs its NCCL layouts.
FAMILIES=(qwen-image flux2 sd3 wan)
families() {
  local device dtype size steps tokens gpus rc=0
  setup || return 1
  local family
  for family in "${FAMILIES[@]}"; do
    local test=$ROOT/tests/integration/test_${family//-/_}_parallel.py
    [[ $family == wan ]] && test=$ROOT/tests/integration/test_wan_tp_parallel.py
    if [[ -f $test ]]; then
      rc=0
      (cd "$ROOT" && DPSERVE_TEST_DEVICE=$device step "math_$family" 150 \
        "$PY" -m pytest "$test" -q -x -p no:cacheprovider -m gang) || rc=$?
      log "$family parallel math on $device: rc=$rc;" \
        "$(grep -v '^[[:space:]]*$' "$OUT/logs/math_$family.log" | tail -n 1)"
    fi
    [[ $family == wan ]] && continue # a video family: bench/video_parallel.py below
    VARIANT=$family-small
    [[ $family == qwen-image && ${DPSERVE_GPU_DRYRUN:-0} != 1 ]] && VARIANT=qwen-image-large
    MODEL=$STATE/model-$VARIANT
    if ! step "build_$family" 150 build_model; then
      log "$family: build failed (logs/build_$family.log)"
      continue
    fi
    step "single_$family" 150 "$PY" "$STEPS_PY" serve-checks --model "$MODEL" --out "$OUT" \
      --device "$device" --dtype "$dtype" --size "$size" --steps "$steps" \
      ${tokens:+--max-sequence-length "$tokens"} ||
      log "$family single: failed (logs/single_$family.log)"
    grep -E '^single' "$OUT/logs/single_$family.log" | sed "s/^/$family /" |
      tee -a "$OUT/summary.txt"
    if ((gpus >= 2)); then
      # shellcheck disable=SC2016  # $@ and $OUT expand in the inner shell
      step "modes_$family" 240 bash -c 'exec "$@" >"$OUT/modes_'"$family"'.txt"' _ \
        "$PY" "$ROOT/bench/parallel_modes.py" --family "$family" --model "$MODEL" \
        --variant "$VARIANT" --device "$device" --dtype "$dtype" --size "$size" \
        --steps "$steps" --rounds 3 --max-foreign 64 ||
        log "$family modes: failed (logs/modes_$family.log)"
      tail -n 1 "$OUT/modes_$family.txt" | tee -a "$OUT/summary.txt"
    fi
  done
  log "total: $((SECONDS - START))s of ${BUDGET}s budget; steps: $(tr '\n' ';' <"$OUT/steps.txt")"
}

case ${1:-} in
prepare) prepare ;;
run) run ;;
families) families ;;
_install | _build_model) "${1#_}" "${@:2}" ;; # step's way into a function, under timeout
*)
  sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
  exit 2
  ;;
esac
