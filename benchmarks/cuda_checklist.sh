#!/usr/bin/env bash
# The CUDA checklist of issue 35 in one command, for a GPU machine reached by copying the
# working tree: the versions, the `cuda`-marked tests and the compiled Triton tests, then the
# step profile, single-stream latency against transformers, offline throughput and live
# appends, on a Gemma 3 270M-shaped model with random weights (speed does not depend on
# the weights). Every step has its own time limit, so one that hangs or fails leaves the
# others' results; each writes its log and JSON under the output folder.
#
#   # here, once (the GGUF is here): the default model's config and tokenizer
#   python benchmarks/random_model.py export --out shared/gemma3-270m-shape
#   # there, from the repository root (Loom runs from the tree; a machine without the `gguf`
#   # package needs its wheel installed first: pip install --target, then PYTHONPATH)
#   benchmarks/cuda_checklist.sh OUT_DIR [STEP ...]    # steps: env tests invariance profile
#                                                      #        latency throughput sessions
#
# The default mode (batch-invariant GEMMs) and `+cublas` (cuBLAS's) are measured side by
# side in invariance, profile, latency and throughput. LOOM_CHECKLIST_HF=1 adds the
# transformers peers to latency and throughput (their compiles take minutes).
set -u
export PYTHONPATH="$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
out=${1:?usage: cuda_checklist.sh OUT_DIR [STEP ...]}
shift
steps=${*:-env tests invariance profile latency throughput sessions}
peers=--no-hf
[[ ${LOOM_CHECKLIST_HF:-0} == 1 ]] && peers="--hf-dtypes bfloat16"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
M=${LOOM_CHECKLIST_MODEL:-shared/gemma3-270m-shape}
PY=${PYTHON:-python3}

# run NAME SECONDS CMD...: a benchmark's stdout (its JSON) to NAME.json and its stderr to
# NAME.log; anything else (tests, the model build) both streams to NAME.log.
run() {
  local name=$1 limit=$2
  shift 2
  echo "=== $name ($(date +%T), limit ${limit}s): $*"
  local began=$SECONDS stdout="$out/$name.log"
  [[ $2 == benchmarks/bench_* ]] && stdout="$out/$name.json"
  timeout --signal=INT --kill-after=15 "$limit" "$@" >"$stdout" 2>>"$out/$name.log"
  local rc=$?
  echo "=== $name: rc=$rc in $((SECONDS - began))s"
  grep -v '^frame #' "$out/$name.log" | tail -n 25
}

if [[ ! -f $M/model.safetensors ]]; then
  run build_model 90 "$PY" benchmarks/random_model.py build --folder "$M" --dtype bfloat16 --device cuda
fi

for step in $steps; do
  case $step in
    env)
      { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
        "$PY" -c 'import torch, triton, transformers; print("torch", torch.__version__,
"cuda", torch.version.cuda, "triton", triton.__version__, "transformers",
transformers.__version__, torch.cuda.get_device_name())'
        grep -m1 'model name' /proc/cpuinfo; nproc; } | tee "$out/env.txt" ;;
    tests)
      run tests_triton 150 "$PY" -m pytest -q -p no:cacheprovider --timeout=180 \
        tests/kernels/test_triton_attention.py tests/kernels/test_triton_compile.py \
        tests/kernels/test_triton_elementwise.py tests/kernels/test_triton_matmul.py \
        tests/runner/test_decode_graphs.py
      run tests_cuda 150 "$PY" -m pytest -q -p no:cacheprovider --timeout=180 -m cuda \
        tests/engine/test_sessions.py tests/engine/test_hooks.py \
        tests/engine/test_speculative.py ;;
    invariance)
      run invariance 240 "$PY" benchmarks/bench_invariance.py --model "$M" --device cuda \
        --modes default default+cublas --no-doc ;;
    profile)
      for mode in default default+cublas; do
        tag=${mode#default}; tag=${tag/+/_}
        run "step_profile$tag" 60 "$PY" benchmarks/bench_step_profile.py --model "$M" \
          --device cuda --context 512 --mode "$mode" --no-doc
        run "step_profile_b64$tag" 60 "$PY" benchmarks/bench_step_profile.py --model "$M" \
          --device cuda --context 256 --batch 64 --mode "$mode" --no-doc
      done ;;
    latency)
      # shellcheck disable=SC2086
      run latency 240 "$PY" benchmarks/bench_latency.py --model "$M" --device cuda \
        --loom-modes default+tok2048 default+tok2048+cublas $peers --hf-static-cache \
        --hf-prompt-lookup 0 --no-llama-cpp --no-doc ;;
    throughput)
      # shellcheck disable=SC2086
      run throughput 200 "$PY" benchmarks/bench_throughput.py --model "$M" --device cuda \
        --loom-modes default default+cublas --num-prompts 64 --input-min 256 \
        --input-max 256 --output-min 128 --output-max 128 $peers --no-llama-cpp --no-doc ;;
    sessions)
      run sessions 150 "$PY" benchmarks/bench_sessions.py --model "$M" --device cuda \
        --contexts 1024 --no-llama-cpp --no-doc ;;
    *) echo "unknown step $step" ;;
  esac
done
