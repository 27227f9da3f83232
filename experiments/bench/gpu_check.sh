#!/usr/bin/env bash
# Every GPU check lcx has, as one prepared run for a machine with one GPU (an H200 here): kernel correctness on the
# GPU first, then the timings. Each stage has its own time limit and log, so a rerun can repeat one stage alone.
#
#   bash experiments/bench/gpu_check.sh                    # env kernels attention decode; logs in $OUT or runs/gpu_check
#   bash experiments/bench/gpu_check.sh decode             # one stage again
#   LCX_GPU_CHECK_QUICK=1 bash experiments/bench/gpu_check.sh   # CPU smoke test of this script (tiny sizes)
#
# Runs from the source tree (PYTHONPATH), with the machine's own jax / torch / transformers: nothing is installed.
# lcx's kernels, generation and these benchmarks import none of the packages such an image may lack (omegaconf and
# tensorboardX are imported only by config files and training). Worst case under 10 minutes (the stage limits add
# up to 580 s, inside one device call); typically 5.
#
# Stages
#   env        GPU, driver, jax / torch versions.
#   kernels    tests/kernels (flash forward / backward, split-K decode, column sums against the pure-jnp oracle, now
#              compiled with Triton) and tests/test_generate.py (the engine with the Pallas kernels as its default).
#   attention  experiments/bench/attention.py, seq 2k-16k: Pallas vs cuDNN vs XLA TFLOP/s (goal: Pallas forward
#              >= 0.55x cuDNN at seq >= 4k).
#   decode     experiments/bench/decode_sweep.py on llama-1b (2.5 GB of bfloat16 weights) against transformers on
#              the same GPU; `roofline` = (weight + KV bytes per step / 4.8 TB/s) / measured decode time per step
#              (goal: >= 50% at batch 1).
#   lowbit     (not in the default run: `gpu_check.sh lowbit`, about 1 minute) experiments/bench/lowbit_kernels.py:
#              one decode step's attention on int4 / int2 codes, the fused XLA formulation vs the Pallas kernel that
#              unpacks tile by tile, against the bfloat16 split-K kernel, at 8k and 32k slots (its correctness is in
#              the kernels stage: tests/kernels/test_lowbit_decode.py).
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
stages=${*:-env kernels attention decode}
failed=""

stage() {  # name, limit in seconds, command...
    local name=$1 limit=$2
    shift 2
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
        stage env 60 bash -c "(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true) &&
            $py -c 'import jax, numpy; print(\"jax\", jax.__version__, jax.devices(), \"numpy\", numpy.__version__)' &&
            ($py -c 'import torch, transformers; print(\"torch\", torch.__version__, torch.cuda.is_available(),
                     \"transformers\", transformers.__version__)' || true)" ;;
    kernels)
        if [ "$quick" = 1 ]; then
            tests="tests/kernels/test_kernels_mode.py tests/kernels/test_kernels_backends.py"
        else
            tests="tests/kernels tests/test_generate.py"
        fi
        # -o addopts=: one process (pytest-xdist's workers would each take the GPU); -rfE names every failure.
        stage kernels 180 $py -m pytest -o addopts= -q -rfE -p no:cacheprovider $tests ;;
    attention)
        if [ "$quick" = 1 ]; then
            stage attention 120 $py experiments/bench/attention.py --quick --seqs 256 --iters 2
        else
            stage attention 120 $py experiments/bench/attention.py --seqs 2048 4096 8192 16384
        fi ;;
    decode)
        if [ "$quick" = 1 ]; then
            stage decode 240 $py experiments/bench/decode_sweep.py --shapes tiny-mha --batches 1 --new 8 --repeats 1
        else
            stage decode 220 $py experiments/bench/decode_sweep.py --shapes llama-1b --dtype bfloat16 \
                --bandwidth 4800 --repeats 2
        fi ;;
    lowbit)
        if [ "$quick" = 1 ]; then
            stage lowbit 120 $py experiments/bench/lowbit_kernels.py --quick
        else
            stage lowbit 120 $py experiments/bench/lowbit_kernels.py --contexts 8192 32768
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
        echo "unknown stage '$s'; allowed: env kernels attention decode lowbit prefill" >&2
        exit 2 ;;
    esac
done

if [ -n "$failed" ]; then
    echo "FAILED stages:$failed (logs in $out)" | tee -a "$out/summary.txt"
    exit 1
fi
echo "all stages passed (logs in $out)" | tee -a "$out/summary.txt"
