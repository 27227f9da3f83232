#!/usr/bin/env bash
# Every GPU check lcx has, as one prepared run for a machine with one GPU (an H100 or H200): kernel correctness on
# the GPU first, then the timings and the parity with transformers. Each stage has its own time limit and log, so a
# rerun can repeat one stage alone.
#
#   bash experiments/bench/gpu_check.sh                    # env kernels lowbit attention decode parity; logs in $OUT
#                                                          # or runs/gpu_check
#   bash experiments/bench/gpu_check.sh decode             # one stage again
#   LCX_GPU_CHECK_QUICK=1 bash experiments/bench/gpu_check.sh   # CPU smoke test of this script (tiny sizes)
#
# Runs from the source tree (PYTHONPATH), with the machine's own jax / torch / transformers: nothing is installed.
# lcx's kernels, generation and these benchmarks import none of the packages such an image may lack (omegaconf and
# tensorboardX are imported only by config files and training). Worst case 8 minutes: the default stages' limits add
# up to 480 s (40 + 150 + 60 + 60 + 90 + 80), inside one 600 s device call with the machine's start (quick mode
# doubles each limit: a CPU compiles slower).
#
# Stages
#   env        GPU, driver, jax / torch versions.
#   kernels    tests/kernels (flash forward / backward, split-K decode, column sums against the pure-jnp oracle, now
#              compiled with Triton) and tests/test_generate.py (the engine with the compiled kernels as its
#              default), `-m "not slow"`: the fast tier has each kernel feature at least once, the slow tier repeats
#              them at more interpreter-sized shapes (one Triton compile each: the first GPU run spent its 180 s on
#              40 tests). `cpu_only` tests (XLA:CPU's own paths) skip themselves off the CPU. Several pytest workers
#              when pytest-xdist is there (compiling is CPU work; the GPU memory is allocated on demand).
#   lowbit     experiments/bench/lowbit_kernels.py: one decode step's attention on int4 / int2 codes, the fused XLA
#              formulation vs the Pallas kernel that unpacks tile by tile, against the bfloat16 split-K kernel, at
#              8k and 32k slots (its correctness is in the kernels stage: tests/kernels/test_lowbit_decode.py).
#   attention  experiments/bench/attention.py, seq 2k-8k: Pallas vs cuDNN vs XLA TFLOP/s (goal: Pallas forward
#              >= 0.55x cuDNN at seq >= 4k). 16k is left out: XLA's forward + backward needs 82 GB there.
#   decode     experiments/bench/decode_sweep.py on llama-1b (2.5 GB of bfloat16 weights) against transformers on
#              the same GPU, one timed call each; `roofline` = (weight + KV bytes per step / 4.8 TB/s) / measured
#              decode time per step (goal: >= 50% at batch 1).
#   parity     experiments/bench/gpu_parity.py: lcx against transformers on the same random Llama- and
#              Gemma-3-shaped weights, float32 with TF32 off / on and bfloat16: logits error, top-1 agreement, the
#              first diverging greedy token per row and the logit margin there against the logit error.
#   prefill    (not in the default run: a second device call, `gpu_check.sh prefill`, about 3 minutes)
#              experiments/bench/prefill.py on llama-1b in bfloat16: prefill 1k-8k tokens and scoring under full /
#              streaming / h2o against transformers on the same GPU (goals: prefill >= 1.0x, scoring <= 3x).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-runs/gpu_check}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
quick=${LCX_GPU_CHECK_QUICK:-0}
stages=${*:-env kernels lowbit attention decode parity}
failed=""

stage() {  # name, limit in seconds, command...
    local name=$1 limit=$2
    shift 2
    # the limits are sized for the GPU run; a CPU smoke run compiles slower (twice the limit, outside the budget)
    [ "$quick" = 1 ] && limit=$((limit * 2))
    echo "== $name (limit ${limit} s): $*" | tee -a "$out/summary.txt"
    local t0=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "== $name: rc $rc in $((SECONDS - t0)) s" | tee -a "$out/summary.txt"
    [ "$rc" = 0 ] || failed="$failed $name"
}

for s in $stages; do
    case $s in
    env)
        stage env 40 bash -c "(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true) &&
            $py -c 'import jax, numpy; print(\"jax\", jax.__version__, jax.devices(), \"numpy\", numpy.__version__)' &&
            ($py -c 'import torch, transformers; print(\"torch\", torch.__version__, torch.cuda.is_available(),
                     \"transformers\", transformers.__version__)' || true)" ;;
    kernels)
        if [ "$quick" = 1 ]; then
            args=(tests/kernels/test_kernels_mode.py tests/kernels/test_kernels_backends.py)
        else
            args=(tests/kernels tests/test_generate.py -m "not slow")
            # a few processes share the GPU (XLA_PYTHON_CLIENT_PREALLOCATE below: each allocates what it uses
            # instead of 75% of the memory up front)
            if $py -c "import xdist" 2>/dev/null; then
                args+=(-n 6)
            fi
        fi
        # -o addopts=: no --dist worksteal without -n (pytest-xdist may be missing); -rfEs names every failure and
        # skip
        stage kernels 150 env XLA_PYTHON_CLIENT_PREALLOCATE=false $py -m pytest -o addopts= -q -rfEs \
            -p no:cacheprovider "${args[@]}" ;;
    attention)
        if [ "$quick" = 1 ]; then
            stage attention 60 $py experiments/bench/attention.py --quick --seqs 256 --iters 2
        else
            stage attention 60 $py experiments/bench/attention.py --seqs 2048 4096 8192 --iters 10
        fi ;;
    decode)
        if [ "$quick" = 1 ]; then
            stage decode 90 $py experiments/bench/decode_sweep.py --shapes tiny-mha --batches 1 --new 8 --repeats 1
        else
            stage decode 90 $py experiments/bench/decode_sweep.py --shapes llama-1b --dtype bfloat16 \
                --bandwidth 4800 --repeats 1
        fi ;;
    lowbit)
        if [ "$quick" = 1 ]; then
            stage lowbit 60 $py experiments/bench/lowbit_kernels.py --quick
        else
            stage lowbit 60 $py experiments/bench/lowbit_kernels.py --contexts 8192 32768 --iters 10
        fi ;;
    parity)
        if [ "$quick" = 1 ]; then
            stage parity 80 $py experiments/bench/gpu_parity.py --quick
        else
            stage parity 80 $py experiments/bench/gpu_parity.py
        fi ;;
    prefill)
        if [ "$quick" = 1 ]; then
            stage prefill 300 $py experiments/bench/prefill.py --lengths 256 --score-length 320 --prefix 64 \
                --repeats 1
        else
            stage prefill 400 $py experiments/bench/prefill.py --shapes llama-1b --dtype bfloat16 \
                --lengths 1024 2048 4096 8192 --score-length 4096 --prefix 512
        fi ;;
    *)
        echo "unknown stage '$s'; allowed: env kernels lowbit attention decode parity prefill" >&2
        exit 2 ;;
    esac
done

if [ -n "$failed" ]; then
    echo "FAILED stages:$failed (logs in $out)" | tee -a "$out/summary.txt"
    exit 1
fi
echo "all stages passed (logs in $out)" | tee -a "$out/summary.txt"
