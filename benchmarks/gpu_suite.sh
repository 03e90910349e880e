#!/usr/bin/env bash
# One call on the GPU machine: build, GPU tests, per-call latency, NCCL collectives, DDP step
# benchmarks (NVLink, NCCL_P2P_DISABLE=1, and that with NCCL's copy-engine SHM copies), doctor;
# on a machine with one GPU, the 1-GPU tests, the wrappers' cost at one rank, the main job and
# doctor. Logs (8 files, the device tool's limit) go to $OUT (or ./gpu_out). Each stage has its
# own time limit and the script goes on after a failing stage, so one run yields every result
# it can.
set -u
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONUNBUFFERED=1 DDPC_CUDA_ARCHS=${DDPC_CUDA_ARCHS:-90}
stage() {  # stage NAME SECONDS CMD...
    local name=$1 secs=$2; shift 2
    local t0=$(date +%s)
    timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name rc=$rc $(( $(date +%s) - t0 ))s"
    tail -n "${TAIL:-25}" "$OUT/$name.log"
}
nvidia-smi --query-gpu=index,name,pci.bus_id,memory.used,memory.total --format=csv,noheader
NGPU=$(nvidia-smi -L | grep -c '^GPU')
stage build 150 $PY -m pip install --no-build-isolation --no-deps -e .
TAIL=6 stage gpu_tests 300 $PY -m pytest -m gpu -q -ra tests/test_gpu.py tests/test_gpu_wrap_model.py
if [ "$NGPU" -ge 2 ]; then
    stage latency 90 $PY benchmarks/latency.py --nproc 2 --iters 1000 --max-bytes 1048576
    stage collectives 120 $PY benchmarks/collectives.py --backend nccl --nproc 2 --min-bytes 1024 \
        --max-bytes 1073741824
    stage ddp_nvlink 120 $PY benchmarks/ddp_step.py --device cuda --nproc 2 --steps 30
    NCCL_P2P_DISABLE=1 stage ddp_nop2p 120 $PY benchmarks/ddp_step.py --device cuda --nproc 2 \
        --steps 30 --p2p off
    # NCCL's host-staged path through its copy engines instead of SM copies (the profile stage,
    # python benchmarks/profile_step.py --nproc 2 --steps 3 --timeline, is left to be run alone:
    # the tool brings back 8 logs).
    NCCL_P2P_DISABLE=1 NCCL_SHM_USE_CUDA_MEMCPY=1 NCCL_SHM_MEMCPY_MODE=3 stage ddp_nop2p_ce 120 \
        $PY benchmarks/ddp_step.py --device cuda --nproc 2 --steps 30 --p2p off \
        --variants "1 process (no DDP),torch DDP,ddpc,ddpc grad_dtype=bf16"
else
    # One GPU: no scaling to measure; what each wrapper costs a step with no peer to wait for,
    # where that host time goes, and the README's main job on the GPU.
    stage ddp_1gpu 150 $PY benchmarks/ddp_step.py --device cuda --nproc 1 --steps 100
    TAIL=40 stage host_1gpu 150 $PY benchmarks/host_phases.py --nproc 1
    TAIL=12 stage main_job 120 $PY -m ddpc.launch --nproc-per-node 1 examples/finetune.py
    stage latency 60 $PY benchmarks/latency.py --nproc 1 --iters 1000 --max-bytes 1048576
fi
TAIL=30 stage doctor 30 $PY -m ddpc.doctor
