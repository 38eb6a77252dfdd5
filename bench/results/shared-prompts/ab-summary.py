import json, statistics as st, sys
for n in sys.argv[1:]:
    rows=[json.loads(l) for l in open(f'/tmp/ab57/{n}/metrics.jsonl')]
    rl=[r for r in rows if 'rl_step' in r]
    sft=[r for r in rows if 'rl_step' not in r and 'perf/train_time' in r]
    f=lambda k: round(st.mean(r[k] for r in rl),2)
    print(f"| {n} | {len(rl)} | {f('perf/step_time')} | {f('perf/rollout_time')} | {f('perf/train_time')} | {round(min(r['perf/train_time'] for r in rl),2)}-{round(max(r['perf/train_time'] for r in rl),2)} | {f('perf/micro_batches')} | {int(st.mean(r.get('perf/shared_prompt_tokens',0) for r in rl))} | {round(sum(r['perf/train_time'] for r in sft),1)} | {[round(r['train/loss'],4) for r in rl[:4]]} |")
