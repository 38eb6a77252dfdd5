# Issue 55 on the machine the real-width batch left warm (wheels in /tmp/site, SGLang in /tmp/sglang-site):
#   T   tests/gpu/test_offload_gpu.py (the overlapped and resident offloads train as one that never left)
#   B   the scaled 2.88B colocated loop as before 2026-12-07: everything moves, copies inside the moves
#   N   the same with the defaults: what fits stays (trainer.resident_budget 0.9), the optimizer state's copies overlapped
#   R   the engines stay (cluster.release_engines=false) at the plan's largest staying pool: nothing moves
# usage: bash .dev/gpu/b55.sh t | main | poll    (t starts T alone, after the wheels; main (after SGLang) runs T unless
#   t started it, then B, N and (H200) R; both detach; poll waits and packs $OUT/res55.tgz). H100 or H200, whichever came.
export PYTHONPATH=/tmp/site:/tmp/w55 VLMRL_CACHE=/tmp/vc PYTHONUNBUFFERED=1
R=/tmp/res55; mkdir -p $R /tmp/runs55
HW=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | awk '{print ($1 > 100000) ? "h200" : "h100"}')
SGF="rollout=sglang rollout.sglang.python=python3 +rollout.sglang.env.PYTHONPATH=/tmp/sglang-site +rollout.sglang.env.SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1 +rollout.sglang.server_args.attention_backend=triton +rollout.sglang.server_args.mm_attention_backend=triton_attn +rollout.sglang.server_args.sampling_backend=pytorch +rollout.sglang.server_args.cuda_graph_backend_prefill=disabled"
LT="[linear_attention,linear_attention,linear_attention,full_attention,linear_attention,linear_attention,linear_attention,full_attention,linear_attention,linear_attention,linear_attention,full_attention]"
# = tests/unit/test_phase_memory.py's H200_SCALED: the scaled command of 2026-12-05 10:55 (bench/results/sglang.md)
SCALED="model=tiny_qwen3_5_moe model.dtype=bfloat16 hardware=$HW cluster.num_gpus=1 cluster.colocate=true hardware.gdn_backend=torch hardware.fused_kernels=false hardware.cuda_graphs=false hardware.lm_attention_backend=sdpa hardware.vision_attn_implementation=sdpa rollout.max_new_tokens=128 algo.sft_steps=0 algo.kl_coef=0 algo.n_samples_per_prompt=8 trainer.global_batch_size=64 model.lm.num_layers=12 model.lm.hidden_size=2048 model.lm.ffn_hidden_size=512 model.lm.num_attention_heads=16 model.lm.num_query_groups=2 model.lm.head_dim=256 model.lm.vocab_size=8192 model.lm.mrope_section=[11,11,10] model.lm.linear_num_key_heads=16 model.lm.linear_num_value_heads=32 model.lm.linear_key_head_dim=128 model.lm.linear_value_head_dim=128 model.lm.num_experts=64 model.lm.moe_router_topk=8 model.lm.moe_ffn_hidden_size=512 model.lm.shared_expert_ffn_hidden_size=512 model.vision.out_hidden_size=2048 rollout.sglang.mem_fraction_static=0.7 model.lm.layer_types=$LT num_steps=6 eval_interval=0 save_interval=0 save_final=false algo.routing_replay=rollout logger.wandb=false $SGF"
# the H100 holds the train phase within 90% at 3072 tokens a micro-batch (the plan's note)
[ $HW = h100 ] && EXTRA="parallel.max_tokens_per_gpu=3072 $EXTRA"
# the coin-flip control gives non-zero advantages, so the variants' losses compare (every reward was 0 at 14:11)
SCALED="$SCALED reward=coin_flip $EXTRA"
# a seventh step traced with torch.profiler on the trainer (step-phases leaves it out of the mean)
TRACE="${TRACE-num_steps=7 profile_steps=[7]}"
mark() { echo "$(date +%H:%M:%S) $*" | tee -a $R/progress.txt; }
run() {  # name, overrides...
  local n=$1; shift
  mark "start $n"
  (cd /tmp/w55 && python3 -m vlmrl.plan $SCALED "$@" > $R/plan-$n.txt 2>&1)
  (cd /tmp/w55 && python3 -m vlmrl.train $SCALED run_dir=/tmp/runs55/$n "$@" > $R/$n.log 2>&1); local rc=$?
  mark "end $n rc=$rc"
}
case "$1" in
t|main)
  # one sequence per machine: a main-bg still running would share the GPU with the new one (14:20 on 2026-12-07)
  if pgrep -f "b55.sh (t|main)-bg" > /dev/null; then echo "a b55 sequence is still running: poll it, or kill it first"; exit 1; fi
  [ -f /tmp/w55/pyproject.toml ] || { mkdir -p /tmp/w55; tar --exclude=./.dev --exclude=./.git -cf - . | tar -xf - -C /tmp/w55; }
  cp $0 /tmp/b55.sh
  setsid nohup bash /tmp/b55.sh $1-bg > $R/$1.out 2>&1 < /dev/null &
  sleep 1 ;;
t-bg)
  mark "start T"; (cd /tmp/w55 && python3 -m pytest -q -s -rA -p no:cacheprovider -m gpu tests/gpu/test_offload_gpu.py > $R/pytest-offload-gpu.log 2>&1; echo "$(date +%H:%M:%S) end T rc=$?" >> $R/progress.txt) ;;
main-bg)
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $R/gpu.txt
  # after the real-width batch, when one runs on this machine
  if [ -f /tmp/res12/progress.txt ]; then while ! grep -q "all done" /tmp/res12/progress.txt; do sleep 2; done; fi
  if grep -q "start T" $R/progress.txt 2>/dev/null; then while ! grep -q "end T" $R/progress.txt; do sleep 2; done; fi
  # the placement's peak (640d3a4) on 18 GiB, before any run builds a trainer
  [ -n "$SKIP_RATE" ] || { grep -q "rate only" /tmp/res12/progress.txt 2>/dev/null && cp /tmp/res12/pytest-rate.log $R/ || mark "start rate"; grep -q "rate only" /tmp/res12/progress.txt 2>/dev/null || (cd /tmp/w55 && python3 -m pytest -q -s -rA -p no:cacheprovider -m gpu tests/gpu/test_offload_gpu.py -k rate > $R/pytest-rate.log 2>&1; echo "$(date +%H:%M:%S) end rate rc=$?" >> $R/progress.txt); }
  grep -q "start T" $R/progress.txt 2>/dev/null || [ -n "$SKIP_T" ] || { mark "start T" && (cd /tmp/w55 && python3 -m pytest -q -s -rA -p no:cacheprovider -m gpu tests/gpu/test_offload_gpu.py > $R/pytest-offload-gpu.log 2>&1; echo "$(date +%H:%M:%S) end T rc=$?" >> $R/progress.txt); }
  while [ -n "$WAIT_SGL" ] && [ ! -f /tmp/sglang-ready ]; do sleep 2; done
  for v in ${ORDER:-B R N}; do
    case $v in
      B) run B trainer.resident_gib=0 trainer.offload_overlap=false $TRACE ;;
      # R: the engines stay (cluster.release_engines=false) at the largest pool the plan allows (0.37):
      # nothing moves in a step but the weights
      R) [ $HW = h200 ] && run R cluster.release_engines=false rollout.sglang.mem_fraction_static=${R_POOL:-0.37} ;;
      N) run N $TRACE ;;
      # O: N's resident split with the copies in the open (overlap off): N's training against O's is the
      # overlapped copy's cost, O's against B's what staying resident changes
      O) run O trainer.offload_overlap=false $TRACE ;;
      # F: N with the trainer's compiled path (the GPU hardware configs' default; the scaled command turns it
      # off): the eager train phase keeps the GPU busy 27% of its forward and backward (16:51's traced step)
      F) run F hardware.fused_kernels=true hardware.cuda_graphs=true $TRACE ;;
    esac
  done
  # S: SGLang's pool at 0.35 of the GPU (8.6M -> 4.0M KV tokens, still 30x what a step holds): the
  # whole state stays, only the gradients are dropped
  [ -n "$WITH_S" ] && run S rollout.sglang.mem_fraction_static=0.35
  (cd /tmp/w55 && python3 -m vlmrl.bench step-phases $(for r in B N O F R S; do [ -f /tmp/runs55/$r/metrics.jsonl ] && echo /tmp/runs55/$r; done) --out $R/phases.md > $R/phases.log 2>&1)
  mark "all done" ;;
poll)
  t0=$(date +%s); limit=${LIMIT:-540}
  pack() {
    rm -rf /tmp/pk55; mkdir -p /tmp/pk55/runs
    for f in $R/*; do tail -c 3000000 $f > /tmp/pk55/$(basename $f); done
    for r in B N O F R S; do [ -d /tmp/runs55/$r ] && mkdir -p /tmp/pk55/runs/$r && { cp /tmp/runs55/$r/metrics.jsonl /tmp/pk55/runs/$r/ 2>/dev/null; \
      tail -c 2000000 /tmp/runs55/$r/logs/sglang-0.log > /tmp/pk55/runs/$r/sglang-0.log 2>/dev/null; tail -c 300000 /tmp/runs55/$r/train.log > /tmp/pk55/runs/$r/train.log 2>/dev/null; \
      [ -d /tmp/runs55/$r/profile ] && cp -r /tmp/runs55/$r/profile /tmp/pk55/runs/$r/; }; done
    tar czf $OUT/res55.tgz.tmp -C /tmp/pk55 . && mv $OUT/res55.tgz.tmp $OUT/res55.tgz
  }
  while true; do
    el=$(( $(date +%s) - t0 ))
    echo "[$el s] $(tail -1 $R/progress.txt 2>/dev/null) | gpu $(nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader) | steps B/N/O/F/R/S: $(for r in B N O F R S; do echo -n "$(cat /tmp/runs55/$r/metrics.jsonl 2>/dev/null | wc -l) "; done)"
    pack
    grep -q "all done" $R/progress.txt 2>/dev/null && break; [ $el -ge $limit ] && break; sleep 20
  done
  cat $R/progress.txt; tail -5 $R/pytest-offload-gpu.log 2>/dev/null; grep -h 'placement\|passed\|failed' $R/pytest-rate.log 2>/dev/null | tail -3
  for f in $R/B.log $R/N.log $R/O.log $R/F.log $R/R.log $R/S.log; do [ -f $f ] && { echo "== $f"; grep -v "Warning\|warn" $f | tail -6 | cut -c1-300; }; done ;;
esac
