#!/usr/bin/env bash
# Every check that needs a CUDA GPU, in one command, each step bounded so one hang leaves
# the others standing. Run from the repository root on a GPU host:
#
#     kernels/gpu_check.sh [STEP ...]     # steps: stack tests bench moe graphs backends parity tp tier (default: all)
#
# DEVICE=cpu runs the stack step with a CPU engine: `python -m kernels.rehearsal` runs it so,
# in a virtual environment with the device image's versions, before any device minute.
#
# Logs and the kernel table go to gpu-out/ (or $CHECK_DIR); summary.txt has one line per
# step. Where $OUT is set (the device tool's folder that comes back, at most 8 files), the
# folder is packed into $OUT/gpu-check.tar.gz after every step, beside summary.txt and
# stack.json, so a call cut off at its limit still returns what finished. What the device
# image lacks comes from .device/ (`python -m kernels.device_bundle` builds it here:
# tritonserver, the front's packages, perf_analyzer, numpy 1 for the backend stubs,
# FlashInfer) and any wheels in .whl/, unpacked into /tmp/site first: the device cannot
# reach PyPI.
set -u
DEVICE=${DEVICE:-cuda}
SITE=${SITE:-/tmp/site}  # where .device/ unpacks
BACK=${OUT:-}  # the device tool's return folder, if any
OUT=${CHECK_DIR:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# FlashInfer compiles its kernels at first use: for this card only, on every core, into a
# cache under the repository (kept between runs on the same host).
if [ "$DEVICE" = cuda ]; then
    CC_MAJOR_MINOR=$(python3 -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")
    export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-${CC_MAJOR_MINOR}a}
fi
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-$PWD/.cache}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}

mkdir -p "$SITE"
export PYTHONPATH=$PYTHONPATH:$SITE PATH=$SITE/bin:$PATH
for archive in .device/site.tar.xz .device/packages.tar.xz .device/flashinfer.tar.xz; do
    [ -f "$archive" ] && tar -xJf "$archive" -C "$SITE"
done
WHEELS=$(compgen -G ".whl/*.whl")
if [ -n "$WHEELS" ]; then
    # shellcheck disable=SC2086
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" $WHEELS
fi

# Each step's limit is sized for the device; DEVICE=cpu runs the kernels in Triton's
# interpreter on a shared host, several times slower: its limits stretch by LIMIT_SCALE.
LIMIT_SCALE=${LIMIT_SCALE:-$([ "$DEVICE" = cuda ] && echo 1 || echo 3)}

# pytest-xdist where it is installed: each kernel variant compiles once per test, on its own core.
XDIST=$(python3 -c "import xdist" 2> /dev/null && echo "-n 8")

step() {  # name, seconds, command...
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    timeout "$((limit * LIMIT_SCALE))" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    echo "$name: exit $rc in $(($(date +%s) - start)) s" | tee -a "$OUT/summary.txt"
    tail -n 40 "$OUT/$name.log"
    if [ -n "$BACK" ] && [ "$BACK" != "$OUT" ]; then
        tar -czf "$BACK/gpu-check.tar.gz" -C "$OUT" . && cp "$OUT/summary.txt" "$BACK/"
        [ -f "$OUT/stack/stack.json" ] && cp "$OUT/stack/stack.json" "$BACK/"
    fi
}

[ "$DEVICE" = cuda ] && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem \
    --format=csv | tee "$OUT/machine.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
    | tee -a "$OUT/machine.txt"
python3 -c "import flashinfer, kernels.flashinfer_paged; print('flashinfer', flashinfer.__version__)" 2>&1 \
    | tail -n 1 | tee -a "$OUT/machine.txt"
# The Python backend stub links this Python's libpython: a missing one is the stack step's first suspect.
for stub in "$SITE"/pytriton/tritonserver/python_backend_stubs/*/triton_python_backend_stub; do
    [ -f "$stub" ] && { echo "$stub:"; LD_LIBRARY_PATH=$(python3 -c "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))") \
        ldd "$stub" | grep -E "python|not found"; } | tee -a "$OUT/machine.txt"
done

for s in "${@:-stack tests bench moe graphs backends parity tp tier}"; do
    for name in $s; do
        case $name in
            stack) step stack 480 python3 -m preble_backend.benchmarks.gpu_stack --device "$DEVICE" --out "$OUT/stack" ;;
            tests) step tests 300 python3 -m pytest -q -p no:cacheprovider --tb=short $XDIST tests/test_kernels.py \
                tests/test_triton_backend.py tests/test_decode_graphs.py tests/test_attention_sdpa.py tests/test_load_and_traces.py \
                tests/test_fused_moe.py ;;
            moe) step moe 240 python3 -m kernels.moe_benchmark ;;
            bench) cp docs/KERNELS.md "$OUT/KERNELS.md"
                step bench 300 python3 -m kernels.benchmark --out "$OUT/KERNELS.md" ;;
            graphs) step graphs 240 python3 -m preble_backend.benchmarks.decode_graphs --json "$OUT/graphs.json" ;;
            backends) step backends 400 python3 -m preble_backend.benchmarks.attention_backends ;;
            tier) step tier 240 python3 -m preble_backend.benchmarks.host_tier --model-path 8b-shape \
                --device cuda --dtype bfloat16 --prefix-lens 1024,4096 --rounds 3 ;;
            tp) step tp 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_tensor_parallel.py ;;
            parity) PREBLE_TEST_DEVICE=cuda step parity 400 python3 -m pytest -q -p no:cacheprovider $XDIST \
                tests/test_parity.py tests/test_host_copy_ahead.py tests/test_host_load_beside.py \
                tests/test_architectures.py tests/test_sliding_windows.py ;;
            *) echo "unknown step $name (stack tests bench moe graphs backends parity tp tier)" >&2; exit 2 ;;
        esac
    done
done
