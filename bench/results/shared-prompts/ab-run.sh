# A/B: the make-train shape (60 SFT steps, 8 prompts x 16 replies), 8 GRPO steps, with and without trainer.share_prompts
cd /work/main
for m in default moe; do
  for sp in false true; do
    extra=""; [ $m = moe ] && extra="experiment=tiny_qwen35_moe"
    /usr/bin/time -f "%e s wall" .venv/bin/python -m vlmrl.train $extra run_dir=/tmp/ab57/$m-$sp num_steps=8 eval_interval=0 \
      trainer.share_prompts=$sp logger.wandb=false logger.progress=false > /tmp/ab57/$m-$sp.log 2>&1
  done
done
echo done > /tmp/ab57/done
