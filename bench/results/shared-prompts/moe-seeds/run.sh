# issue 57 item 2's protocol: the MoE recipe, each seed with its own warm-up (seed=S data.seed=S), one run at a time, two threads
cd /work/main
for S in 1234 1 2; do
  .venv/bin/python -m vlmrl.train experiment=tiny_qwen35_moe seed=$S data.seed=$S run_dir=/tmp/moe57/s$S \
    logger.wandb=false logger.progress=false > /tmp/moe57/s$S.log 2>&1
done
echo done > /tmp/moe57/done
