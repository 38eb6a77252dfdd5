# The real-width loop, its checkpoint, resume and HF export on one H100 or H200 (whichever comes), in one machine start:
#   prep (after the wheels): build the real-width checkpoint(s) on the GPU; tests/gpu/test_checkpoint_gpu.py beside it
#   main (after SGLang's shares):
#     A  routing replay, GRPO steps (H100: 3, the five-step run is in bench/results; H200: 5), HF export (to /dev/shm: the disk holds 54 GiB);
#        H100: two layers (1 GDN + 1 gated attention), 2048-token micro-batches, end checkpoint (41 GiB)
#        H200: four layers, 4096-token micro-batches, no checkpoint (63 GiB would not fit the disk)
#     H  hfcheck.py on A's export (transformers + SGLang greedy); H100: H1 transformers, then C (resumes A's checkpoint
#        for one step without replay, return_routed_experts on: the resume, the gap without replay), then H2 SGLang
#     H200: C1 two layers 1 step + save, C2 resume + 1 step without replay (the gap without replay)
# usage: bash .dev/gpu/batch12.sh prep | main | poll   (prep and main detach; poll waits and packs $OUT/res.tgz)
export PYTHONPATH=/tmp/site:/tmp/w VLMRL_CACHE=/tmp/vc PYTHONUNBUFFERED=1
R=/tmp/res12; mkdir -p $R /tmp/runs
HW=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | awk '{print ($1 > 100000) ? "h200" : "h100"}')
SGF="rollout=sglang rollout.sglang.python=python3 +rollout.sglang.env.PYTHONPATH=/tmp/sglang-site +rollout.sglang.env.SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1 +rollout.sglang.server_args.attention_backend=triton +rollout.sglang.server_args.mm_attention_backend=triton_attn +rollout.sglang.server_args.sampling_backend=pytorch +rollout.sglang.server_args.cuda_graph_backend_prefill=disabled +rollout.sglang.server_args.disable_decode_cuda_graph=true"
BASE="model=qwen3_5_35b_a3b hardware=$HW cluster.num_gpus=1 cluster.colocate=true rollout.num_gpus=1 data=synthetic data.min_pixels=3136 data.max_pixels=1003520 data.max_prompt_length=2048 data.synthetic.image_size=512 data.synthetic.num_train=256 data.synthetic.num_test=16 algo.sft_steps=0 algo.kl_coef=0 algo.n_samples_per_prompt=8 rollout.batch_size=8 trainer.global_batch_size=64 rollout.max_new_tokens=512 hardware.lm_attention_backend=sdpa hardware.vision_attn_implementation=sdpa hardware.gdn_backend=torch hardware.cuda_graphs=false reward=coin_flip eval_interval=0 logger.wandb=false trainer.optim.lr=1e-6 $SGF"
L2="model.lm.num_layers=2 model.lm.layer_types=[linear_attention,full_attention] parallel.max_tokens_per_gpu=2048"
L4="model.lm.num_layers=4 parallel.max_tokens_per_gpu=4096"
NOREPLAY="algo.routing_replay=none rollout.return_routed_experts=true"
mark() { echo "$(date +%H:%M:%S) $*" | tee -a $R/progress.txt; }
run() {  # name, overrides...
  local n=$1; shift
  mark "start $n"
  (cd /tmp/w && python3 -m vlmrl.plan $BASE "$@" > $R/plan-$n.txt 2>&1)
  (cd /tmp/w && python3 -m vlmrl.train $BASE "$@" > $R/$n.log 2>&1); local rc=$?
  mark "end $n rc=$rc"; df -h /tmp | tail -1 >> $R/progress.txt
  return $rc
}
build() {  # out, overrides...
  local out=$1; shift
  (cd /tmp/w && /usr/bin/time -v python3 -m vlmrl.models.random_init --out $out --device cuda data=geo3k model=qwen3_5_35b_a3b "$@" \
     > $R/build-$(basename $out).log 2> $R/build-$(basename $out).time)
  local rc=$?; mark "built $out rc=$rc $(du -sh $out | cut -f1)"
}
hfdir() { mkdir -p /dev/shm/hf-$1 /tmp/runs/$1; ln -sfn /dev/shm/hf-$1 /tmp/runs/$1/hf; }
copytree() { rm -rf /tmp/w; mkdir -p /tmp/w; tar --exclude=./.dev --exclude=./.git -cf - . | tar -xf - -C /tmp/w; cp .dev/gpu/*.py /tmp/w/ 2>/dev/null; }
case "$1" in
prep)
  copytree; rm -rf /tmp/wp; cp -r /tmp/w /tmp/wp; cp $0 /tmp/b12.sh
  setsid nohup bash /tmp/b12.sh prep-bg > $R/prep.out 2>&1 < /dev/null &
  sleep 2; cat $R/progress.txt ;;
prep-bg)
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $R/gpu.txt; free -g > $R/free-start.txt; df -h / /tmp /dev/shm > $R/df-start.txt
  (while true; do echo "$(date +%s) $(free -b | awk '/Mem:/{print $3, $2}') $(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits)"; sleep 1; done > $R/host-mem.txt) &
  mark "prep on $HW"
  (cd /tmp/wp && python3 -m pytest -q -p no:cacheprovider tests/gpu/test_checkpoint_gpu.py -m gpu > $R/pytest-checkpoint-gpu.log 2>&1; rc=$?; echo "$(date +%H:%M:%S) gpu test rc=$rc" >> $R/progress.txt) &
  TP=$!
  if [ $HW = h200 ]; then build /tmp/rw4 model.lm.num_layers=4; fi
  build /tmp/rw2 model.lm.num_layers=2 "model.lm.layer_types=[linear_attention,full_attention]"
  wait $TP; mark "prep done" ;;
main)
  copytree; cp $0 /tmp/b12.sh
  setsid nohup bash /tmp/b12.sh main-bg > $R/main.out 2>&1 < /dev/null &
  sleep 1 ;;
main-bg)
  while ! grep -q "prep done" $R/progress.txt; do sleep 2; done
  if [ $HW = h100 ]; then
    hfdir A
    run A $L2 model.path=/tmp/rw2 num_steps=3 algo.routing_replay=rollout save_hf=true run_dir=/tmp/runs/A
    du -sh /tmp/runs/A/checkpoints/* /dev/shm/hf-A >> $R/progress.txt 2>&1
    mark "start H1"; (cd /tmp/w && python3 hfcheck.py /tmp/runs/A/hf $R hf-only > $R/hfcheck-hf.log 2>&1); rc=$?; mark "end H1 rc=$rc"
    run C $L2 model.path=/tmp/rw2 num_steps=4 $NOREPLAY save_final=false run_dir=/tmp/runs/A \
      || run B $L2 model.path=/tmp/rw2 num_steps=1 $NOREPLAY save_final=false run_dir=/tmp/runs/B
    mark "start H2"; (cd /tmp/w && python3 hfcheck.py /tmp/runs/A/hf $R sglang-only > $R/hfcheck.log 2>&1); rc=$?; mark "end H2 rc=$rc"
    rm -rf /dev/shm/hf-A
  else
    hfdir A
    run A $L4 model.path=/tmp/rw4 num_steps=5 algo.routing_replay=rollout save_final=false save_hf=true run_dir=/tmp/runs/A
    mark "start H"; (cd /tmp/w && python3 hfcheck.py /tmp/runs/A/hf $R > $R/hfcheck.log 2>&1); rc=$?; mark "end H rc=$rc"
    rm -rf /dev/shm/hf-A
    rm -rf /tmp/rw4
    run C1 $L2 model.path=/tmp/rw2 num_steps=1 algo.routing_replay=rollout run_dir=/tmp/runs/C
    du -sh /tmp/runs/C/checkpoints/* >> $R/progress.txt 2>&1
    run C2 $L2 model.path=/tmp/rw2 num_steps=2 $NOREPLAY save_final=false run_dir=/tmp/runs/C
  fi
  mark "all done" ;;
poll)  # wait until all done or LIMIT seconds, packing what there is into $OUT/res.tgz every 20 s
  t0=$(date +%s); limit=${LIMIT:-540}
  pack() {
    rm -rf /tmp/pk; mkdir -p /tmp/pk/runs
    for f in $R/*; do tail -c 4000000 $f > /tmp/pk/$(basename $f); done
    for r in A B C; do [ -d /tmp/runs/$r ] && mkdir -p /tmp/pk/runs/$r && cp /tmp/runs/$r/metrics.jsonl /tmp/runs/$r/summary.json /tmp/pk/runs/$r/ 2>/dev/null \
      && tail -c 3000000 /tmp/runs/$r/logs/sglang-0.log > /tmp/pk/runs/$r/sglang-0.log 2>/dev/null; done
    tar czf $OUT/res.tgz.tmp -C /tmp/pk . && mv $OUT/res.tgz.tmp $OUT/res.tgz
  }
  while true; do
    el=$(( $(date +%s) - t0 ))
    echo "[$el s] $(tail -1 $R/progress.txt 2>/dev/null) | gpu $(nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader) | host $(free -g | awk '/Mem:/{print $3}') GiB | disk $(df -h /tmp | awk 'NR==2{print $4}') | steps A/B/C: $(for r in A B C; do echo -n "$(wc -l < /tmp/runs/$r/metrics.jsonl 2>/dev/null) "; done)"
    pack
    grep -q "all done" $R/progress.txt 2>/dev/null && break; [ $el -ge $limit ] && break; sleep 20
  done
  cat $R/progress.txt
  for f in $R/A.log $R/B.log $R/C.log $R/C1.log $R/C2.log; do [ -f $f ] && { echo "== $f"; grep -v "Warning\|warn" $f | tail -8 | cut -c1-300; }; done ;;
esac
