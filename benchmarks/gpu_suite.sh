#!/usr/bin/env bash
# One call on the GPU machine: build, GPU tests, per-call latency, the reducer's casts'
# bandwidth, NCCL collectives, DDP step
# benchmarks (NVLink, NCCL_P2P_DISABLE=1, and that with DDPC_STAGED_OVERLAP=0), doctor;
# on a machine with one GPU, the 1-GPU tests, the wrappers' cost at one rank, the main job and
# doctor. Each stage's log goes to $LOGS (/tmp/ddpc_gpu_logs) and is appended to
# $OUT/suite.log as the stage ends, so one file holds everything even when the call is cut short.
# Each stage has its own time limit and the script goes on after a failing stage, so one run
# yields every result it can. STAGES="name ..." runs only the named stages (build always runs);
# EXTRA="cmd" runs one more shell command as the stage "extra" at the end (whatever STAGES says);
# DDP_ARGS="..." are added to every ddp_step.py command.
set -u
OUT=${OUT:-$PWD/gpu_out}
LOGS=${LOGS:-${TMPDIR:-/tmp}/ddpc_gpu_logs}
mkdir -p "$OUT" "$LOGS"
STAGES=${STAGES:-}
PY=${PY:-python3}
export PYTHONUNBUFFERED=1 DDPC_CUDA_ARCHS=${DDPC_CUDA_ARCHS:-90}
stage() {  # stage NAME SECONDS CMD...
    local name=$1 secs=$2; shift 2
    if [ -n "$STAGES" ] && [ "$name" != build ] && [ "$name" != extra ] &&
        [[ " $STAGES " != *" $name "* ]]; then
        return 0
    fi
    local t0=$(date +%s)
    timeout "$secs" "$@" > "$LOGS/$name.log" 2>&1
    local rc=$?
    local head="== $name rc=$rc $(( $(date +%s) - t0 ))s"
    echo "$head"
    tail -n "${TAIL:-25}" "$LOGS/$name.log"
    { echo "$head"; cat "$LOGS/$name.log"; } >> "$OUT/suite.log"
}
nvidia-smi --query-gpu=index,name,pci.bus_id,memory.used,memory.total --format=csv,noheader
# Processes already on the GPUs (a machine kept warm between calls may still run an earlier
# call's ranks): listed here and again at the end, into suite.log too.
apps() { echo "== GPU processes ($1):"; nvidia-smi --query-compute-apps=pid,process_name,used_memory \
    --format=csv,noheader 2>&1 | sed 's/^/   /'; ps -eo pid,ppid,etime,cmd | grep -E "python.*(pytest|ddpc|test_)" \
    | grep -v grep | sed 's/^/   /'; }
apps start | tee -a "$OUT/suite.log"
NGPU=$(nvidia-smi -L | grep -c '^GPU')
stage build 150 $PY -m pip install --no-build-isolation --no-deps -e .
TAIL=6 stage gpu_tests 360 $PY -m pytest -m gpu -q -ra tests/test_gpu.py tests/test_gpu_wrap_model.py
if [ "$NGPU" -ge 2 ]; then
    # (--control: the default ddpc variants twice, so each table shows its own noise)
    stage ddp_nvlink 120 $PY benchmarks/ddp_step.py --device cuda --nproc 2 --steps 30 --control \
        ${DDP_ARGS:-}
    NCCL_P2P_DISABLE=1 stage ddp_nop2p 120 $PY benchmarks/ddp_step.py --device cuda --nproc 2 \
        --steps 30 --p2p off --control ${DDP_ARGS:-}
    # The staged all-reduce with each call waiting for the one before (NCCL's own copy-engine
    # SHM mode, NCCL_SHM_USE_CUDA_MEMCPY=1, printed nothing in 120 s here).
    NCCL_P2P_DISABLE=1 DDPC_STAGED_OVERLAP=0 stage ddp_nop2p_serial 120 \
        $PY benchmarks/ddp_step.py --device cuda --nproc 2 --steps 30 --p2p off \
        --variants "1 process (no DDP),torch DDP,ddpc,ddpc grad_dtype=bf16" ${DDP_ARGS:-}
    stage latency 90 $PY benchmarks/latency.py --nproc 2 --iters 1000 --max-bytes 1048576
    stage collectives 120 $PY benchmarks/collectives.py --backend nccl --nproc 2 --min-bytes 1024 \
        --max-bytes 1073741824
    NCCL_P2P_DISABLE=1 stage collectives_nop2p 100 $PY benchmarks/collectives.py --backend nccl \
        --nproc 2 --min-bytes 1048576 --max-bytes 268435456
else
    # One GPU: no scaling to measure; what each wrapper costs a step with no peer to wait for,
    # where that host time goes, and the README's main job on the GPU.
    stage ddp_1gpu 150 $PY benchmarks/ddp_step.py --device cuda --nproc 1 --steps 100 ${DDP_ARGS:-}
    TAIL=40 stage host_1gpu 150 $PY benchmarks/host_phases.py --nproc 1
    TAIL=12 stage main_job 120 $PY -m ddpc.launch --nproc-per-node 1 examples/finetune.py
    # Only when STAGES names them (shared_main_job, shared_tests: about 8 minutes): the main job
    # and the 2-rank GPU tests with both ranks on this one GPU (DDPC_SHARE_GPUS=1: NCCL's network
    # transport between them).
    if [[ " $STAGES " == *" shared_"* ]]; then
        DDPC_SHARE_GPUS=1 TAIL=12 stage shared_main_job 120 $PY -m ddpc.launch \
            --nproc-per-node 2 examples/finetune.py
        DDPC_SHARE_GPUS=1 TAIL=8 stage shared_tests 480 $PY -m pytest -m gpu -q -ra \
            tests/test_gpu.py tests/test_gpu_wrap_model.py -k "2gpu or not 1gpu"
    fi
    stage latency 60 $PY benchmarks/latency.py --nproc 1 --iters 1000 --max-bytes 1048576
fi
stage casts 120 $PY benchmarks/cast_bandwidth.py
TAIL=30 stage doctor 30 $PY -m ddpc.doctor
if [ -n "${EXTRA:-}" ]; then
    stage extra "${EXTRA_SECS:-120}" bash -c "$EXTRA"
fi
apps end | tee -a "$OUT/suite.log"
