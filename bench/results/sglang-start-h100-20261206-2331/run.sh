# SGLang 0.5.17's start on one GPU, tiny Qwen3.5-MoE (bf16), flags as vlmrl builds them for
# experiment=tiny_qwen35_moe rollout=sglang colocated: decode CUDA graphs bounded by the step's batch
# (128) or SGLang's default bound; compile caches (triton, inductor, tvm-ffi, flashinfer, deep_gemm,
# sglang) under one folder: empty (cold) or filled by an earlier start (warm).
# usage: bash .dev/sgs/run.sh   (after .dev/sglang a and b are installed; /tmp/tiny holds the model)
O=${OUT:-/tmp/sgs-out}; mkdir -p $O
ARGS="--model-path /tmp/tiny --tp-size 1 --ep-size 1 --mem-fraction-static 0.7 --dtype bfloat16 --host 127.0.0.1 --port 30000 --log-level info --mm-attention-backend triton_attn --enable-memory-saver --mm-process-config {\"image\":{\"min_pixels\":3136,\"max_pixels\":16384}} --attention-backend triton --sampling-backend pytorch --cuda-graph-backend-prefill disabled"
start() {  # name cachedir extra-args
  local name=$1 cc=$2; shift 2
  mkdir -p $cc
  local t0=$(date +%s.%N)
  env PYTHONPATH=/tmp/sglang-site SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1 TORCHINDUCTOR_CACHE_DIR=$cc/inductor TRITON_CACHE_DIR=$cc/triton \
    TVM_FFI_CACHE_DIR=$cc/tvm_ffi FLASHINFER_WORKSPACE_BASE=$cc/flashinfer SGLANG_DG_CACHE_DIR=$cc/deep_gemm SGLANG_CACHE_DIR=$cc/sglang \
    setsid python3 -m sglang.launch_server $ARGS "$@" > $O/$name.log 2>&1 &
  local pid=$!
  local ok=no
  for i in $(seq 1 1200); do
    if curl -sf -m 2 http://127.0.0.1:30000/health > /dev/null 2>&1; then ok=yes; break; fi
    kill -0 $pid 2>/dev/null || break
    sleep 0.25
  done
  local t1=$(date +%s.%N)
  echo "$name healthy=$ok seconds=$(python3 -c "print(round($t1 - $t0, 1))") cache_files=$(find $cc -type f | wc -l) cache=$(du -sh $cc | cut -f1)" | tee -a $O/summary.txt
  grep -i "capture\|cuda graph\|bs=\|Load weight end\|ready to roll\|max_cuda_graph\|cuda_graph_bs" $O/$name.log | cut -c1-240 | tail -8 > $O/$name.capture.txt
  kill -- -$pid 2>/dev/null; sleep 3; kill -9 -- -$pid 2>/dev/null; sleep 2
  while curl -s -m 1 http://127.0.0.1:30000/health > /dev/null 2>&1; do sleep 1; done
}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $O/gpu.txt
start cold-bounded /tmp/ccA --cuda-graph-max-bs-decode 128
start warm-bounded /tmp/ccA --cuda-graph-max-bs-decode 128
start warm-default /tmp/ccA
# (a cold start without the bound: not run, device time)
cat $O/summary.txt
