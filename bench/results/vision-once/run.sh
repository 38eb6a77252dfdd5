set -x
for rep in 1 2; do
cd /tmp/wt-before && PYTHONPATH=/tmp/wt-before /work/main/.venv/bin/python -m vlmrl.train experiment=tiny_qwen35_moe algo.sft_steps=0 num_steps=8 eval_interval=0 save_final=false logger.wandb=false logger.progress=false run_dir=/tmp/dedup/before$rep > /tmp/dedup/before$rep.log 2>&1
cd /work/main && PYTHONPATH=/work/main .venv/bin/python -m vlmrl.train experiment=tiny_qwen35_moe algo.sft_steps=0 num_steps=8 eval_interval=0 save_final=false logger.wandb=false logger.progress=false run_dir=/tmp/dedup/after$rep > /tmp/dedup/after$rep.log 2>&1
done
