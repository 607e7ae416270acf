#!/usr/bin/env bash
# First contact with a CUDA machine, from the checkout (no install: PYTHONPATH).
#
#   benchmarks/gpu_first_contact.sh check        env probe, kernel resources, smoke run, GPU tests
#   benchmarks/gpu_first_contact.sh bench-small  benchmarks/bench_gpu.py on the small shape
#   benchmarks/gpu_first_contact.sh bench-ds     benchmarks/bench_gpu.py on DeepSeek-V3 (experts cut to fit)
#   benchmarks/gpu_first_contact.sh bench-qwen3  ... on Qwen3-30B-A3B; bench-mixtral on Mixtral-8x7B
#   benchmarks/gpu_first_contact.sh bench-default  the default path and the torch variants alone
#                                                (--peers-only), on all four shapes
#   benchmarks/gpu_first_contact.sh profile-ds   benchmarks/gpu_profile.py there: the default path's kernels
#                                                and idle time against torch's grouped-GEMM layer
#   benchmarks/gpu_first_contact.sh default      the default path's GPU tests (tests/test_gpu_default.py: no host
#                                                sync, the graph-captured step, NCCL; tests/test_offload.py's),
#                                                then bench-default with the transformers blocks, host syncs,
#                                                memory, held memory with and without offload, host time (balanced)
#   benchmarks/gpu_first_contact.sh default-zipf the same bench on zipf routing, then profile-ds
#   benchmarks/gpu_first_contact.sh lent         what the open GPU issues need first, in one call of at most 8
#                                                minutes: the default path's and the per-shape program's GPU tests
#                                                (no host sync, the graph-captured steps, NCCL, offload), the bench
#                                                on all four shapes with the transformers blocks, host syncs, memory
#                                                and the hpmoe-persistent rows (balanced), the issues' goals read
#                                                off it (benchmarks/gpu_verdict.py, into lent.log), then a
#                                                per-shape step's host time; run default-zipf after it where
#                                                time is left
#   benchmarks/gpu_first_contact.sh persistent   the per-shape program's GPU tests (tests/test_triton_gpu_slots.py),
#                                                then bench-default with the hpmoe-persistent rows (the layer on
#                                                the persistent kernel, a new routing every step) on small,
#                                                Qwen3-30B-A3B and DeepSeek-V3; before the bench, a step's host
#                                                time with a cached plan (benchmarks/slot_plan_cost.py on cuda)
#
# Writes under $OUT (default benchmarks/results/first-contact), each file as soon as its step
# ends: env.txt, check.log, smoke.json (resources compiled on the device, a smoke run with a
# 2 s deadline against moe_forward, the layer on CUDA), gpu-tests.xml (JUnit); bench.log,
# bench-SHAPE.json, one timeline PNG; gpu_profile.json (its log goes to bench.log): at
# most 8 files for check, bench-ds and profile-ds, or check and two benches, in one
# folder; default writes default-tests.xml, default.log and bench-default.json, default-zipf
# bench-default-zipf.json and gpu_profile.json; persistent writes persistent-tests.xml,
# slot-plan-cost.json and bench-persistent.json; lent writes env.txt, lent-default-tests.xml,
# lent-slot-tests.xml, lent.log, bench.log, bench-lent.json and slot-plan-cost.json (7 files).
# Every step runs under `timeout -s KILL`; a call stays under 9 minutes (lent under 8).
# Without a CUDA device it exits 2 at once.
set -u
mode=${1:-check}
here=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-$here/benchmarks/results/first-contact}
py=${PYTHON:-python3}
export PYTHONPATH=$here${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1

modes="check|bench-small|bench-ds|bench-qwen3|bench-mixtral|bench-default|profile-ds|default|default-zipf|persistent|lent"
case "|$modes|" in *"|$mode|"*) ;; *) echo "usage: $0 {$modes}" >&2; exit 64;; esac
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_first_contact.sh: no CUDA device here (nvidia-smi finds none)" >&2
    exit 2
fi
mkdir -p "$out"
cd "$here" || exit 1
status=0
step() {  # step SECONDS LOG COMMAND...: run under a hard limit, append to LOG, remember a failure
    local limit=$1 log=$2; shift 2
    echo "== $* (limit ${limit}s)" | tee -a "$log"
    timeout -s KILL "$limit" "$@" 2>&1 | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    echo "== exit $rc" | tee -a "$log"
    [ "$rc" -eq 0 ] || status=1
}

timeout_opt() {  # a per-test limit where pytest-timeout is installed
    "$py" -c 'import pytest_timeout' 2>/dev/null && echo --timeout=90
}

bench() {  # bench NAME SHAPE... [FLAGS]: its JSON, the shared log, the first timeline PNG of the folder
    local name=$1 tmp
    shift
    tmp=$(mktemp -d)
    step "${FC_LIMIT_BENCH:-420}" "$out/bench.log" "$py" benchmarks/bench_gpu.py --out "$tmp" --reps 10 \
        --warmup 3 --shapes "$@"
    cp "$tmp/bench_gpu.json" "$out/bench-$name.json" 2>/dev/null
    ls "$out"/timeline-*.png >/dev/null 2>&1 || cp "$tmp/timeline-$1-hyperparallel.png" "$out/timeline-$1.png" 2>/dev/null
    rm -rf "$tmp"
}

case $mode in
check)
    log=$out/check.log
    { nvidia-smi; "$py" -c 'import torch, triton, platform; print("torch", torch.__version__, "cuda",
torch.version.cuda, "triton", triton.__version__, "python", platform.python_version())'; } >"$out/env.txt" 2>&1
    step "${FC_LIMIT_SMOKE:-120}" "$log" "$py" benchmarks/gpu_smoke.py --json "$out/smoke.json"
    step "${FC_LIMIT_TESTS:-300}" "$log" "$py" -m pytest -m gpu -p no:cacheprovider --maxfail 8 -q $(timeout_opt) \
        --junitxml "$out/gpu-tests.xml" tests/test_triton_gpu.py
    ;;
bench-small) bench small small ;;
bench-ds) bench deepseek-v3-fit deepseek-v3-fit ;;
bench-qwen3) bench qwen3-30b-a3b qwen3-30b-a3b ;;
bench-mixtral) bench mixtral-8x7b mixtral-8x7b ;;
bench-default) bench default qwen3-30b-a3b small mixtral-8x7b deepseek-v3-fit --peers-only ;;
profile-ds) step "${FC_LIMIT_BENCH:-420}" "$out/bench.log" "$py" benchmarks/gpu_profile.py --out "$out" ;;
lent)
    { nvidia-smi; "$py" -c 'import torch, triton, transformers, platform; print("torch", torch.__version__,
"triton", triton.__version__, "transformers", transformers.__version__, "python", platform.python_version())'
    } >"$out/env.txt" 2>&1
    # two pytest runs: a run killed at its limit writes no report, so each keeps its own
    step "${FC_LIMIT_TESTS:-100}" "$out/lent.log" "$py" -m pytest -m gpu -p no:cacheprovider -q -rA \
        $(timeout_opt) --junitxml "$out/lent-default-tests.xml" tests/test_gpu_default.py tests/test_offload.py
    step "${FC_LIMIT_SLOT_TESTS:-100}" "$out/lent.log" "$py" -m pytest -m gpu -p no:cacheprovider -q -rA \
        $(timeout_opt) --junitxml "$out/lent-slot-tests.xml" tests/test_triton_gpu_slots.py
    FC_LIMIT_BENCH=${FC_LIMIT_BENCH:-240} bench lent qwen3-30b-a3b small deepseek-v3-fit mixtral-8x7b \
        --peers-only --persistent-layer --routing balanced
    [ -f "$out/bench-lent.json" ] && step 30 "$out/lent.log" "$py" benchmarks/gpu_verdict.py "$out/bench-lent.json"
    step "${FC_LIMIT_PLAN:-40}" "$out/lent.log" "$py" benchmarks/slot_plan_cost.py --device cuda \
        --shapes qwen3-30b-a3b small --steps 20 --json "$out/slot-plan-cost.json"
    ;;
default)
    { nvidia-smi; "$py" -c 'import torch, triton, transformers, platform; print("torch", torch.__version__,
"triton", triton.__version__, "transformers", transformers.__version__, "python", platform.python_version())'
    } >"$out/env.txt" 2>&1
    step "${FC_LIMIT_TESTS:-150}" "$out/default.log" "$py" -m pytest -m gpu -p no:cacheprovider -q -rA \
        $(timeout_opt) --junitxml "$out/default-tests.xml" tests/test_gpu_default.py \
        tests/test_offload.py
    FC_LIMIT_BENCH=${FC_LIMIT_BENCH:-300} bench default small qwen3-30b-a3b mixtral-8x7b deepseek-v3-fit \
        --peers-only --routing balanced
    ;;
default-zipf)
    FC_LIMIT_BENCH=${FC_LIMIT_BENCH:-300} bench default-zipf small qwen3-30b-a3b mixtral-8x7b deepseek-v3-fit \
        --peers-only --routing zipf
    step "${FC_LIMIT_PROFILE:-120}" "$out/bench.log" "$py" benchmarks/gpu_profile.py --out "$out"
    ;;
persistent)
    step "${FC_LIMIT_TESTS:-150}" "$out/persistent.log" "$py" -m pytest -m gpu -p no:cacheprovider -q -rA \
        $(timeout_opt) --junitxml "$out/persistent-tests.xml" tests/test_triton_gpu_slots.py
    step "${FC_LIMIT_PLAN:-120}" "$out/persistent.log" "$py" benchmarks/slot_plan_cost.py --device cuda \
        --shapes qwen3-30b-a3b small --steps 40 --json "$out/slot-plan-cost.json"
    FC_LIMIT_BENCH=${FC_LIMIT_BENCH:-300} bench persistent small qwen3-30b-a3b deepseek-v3-fit \
        --peers-only --persistent-layer --routing balanced
    ;;
esac
exit $status
