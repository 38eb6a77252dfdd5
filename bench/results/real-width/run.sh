# Issue 54 item 1: the reference model's first four layers at real width, drawn on the GPU, then
# loaded by transformers (one image forward) and by SGLang 0.5.17 (one image generate).
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 VLMRL_CACHE=/tmp/vc
R=$OUT; CK=/tmp/rw4; M="model=qwen3_5_35b_a3b model.lm.num_layers=4 data=geo3k"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $R/gpu.txt
t0=$(date +%s)
/usr/bin/time -v python3 -m vlmrl.models.random_init --out $CK --device cuda $M > $R/build.log 2> $R/build.time
echo "build rc=$? $(( $(date +%s) - t0 )) s"; tail -2 $R/build.log; grep -E "Maximum resident|Elapsed" $R/build.time
du -sh $CK; ls $CK | tr '\n' ' '; echo
python3 - > $R/hf-load.log 2>&1 <<'PY'
import json, time, torch
from PIL import Image
from transformers import AutoModelForImageTextToText
from vlmrl.config import load
from vlmrl.models.bridge import check_checkpoint
from vlmrl.models.processor import load_processor
from vlmrl.models.sglang_checkpoint import check_sglang_checkpoint
cfg = load(["model=qwen3_5_35b_a3b", "model.lm.num_layers=4"], check_rules=False)
check_checkpoint(cfg.model, "/tmp/rw4"); check_sglang_checkpoint(cfg.model, "/tmp/rw4", sglang_version="0.5.17")
print("vlmrl checks: ok")
t = time.time()
net = AutoModelForImageTextToText.from_pretrained("/tmp/rw4", dtype=torch.bfloat16, device_map="cuda").eval()
print(f"from_pretrained {time.time() - t:.1f} s; {sum(p.numel() for p in net.parameters()) / 1e9:.3f}B; {type(net).__name__}")
proc = load_processor("/tmp/rw4", min_pixels=3136, max_pixels=1003520)
msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Find x. Answer: \\boxed{}"}]}]
prompt = proc.apply_chat_template(msgs, add_generation_prompt=True)
b = proc(text=[prompt], images=[Image.new("RGB", (640, 480), "white")], return_tensors="pt").to("cuda")
with torch.no_grad():
    out = net(**b)
print("image tokens", int((b["input_ids"] == 248056).sum()), "logits", tuple(out.logits.shape), "finite", bool(torch.isfinite(out.logits).all()))
print("peak GiB", torch.cuda.max_memory_allocated() / 2**30)
PY
echo "hf rc=$?"; tail -6 $R/hf-load.log
PYTHONPATH=/tmp/sglang-site SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1 setsid python3 -m sglang.launch_server --model-path $CK \
  --port 31000 --mem-fraction-static 0.5 --attention-backend triton --mm-attention-backend triton_attn \
  --sampling-backend pytorch --disable-cuda-graph --log-level warning > $R/sglang.log 2>&1 < /dev/null &
t0=$(date +%s)
until curl -sf localhost:31000/health > /dev/null; do sleep 3; [ $(( $(date +%s) - t0 )) -gt 240 ] && break; done
echo "sglang healthy after $(( $(date +%s) - t0 )) s"
python3 - <<'PY' 2>&1 | tee $R/sglang-generate.log
import base64, io, json, urllib.request
from PIL import Image
buf = io.BytesIO(); Image.new("RGB", (640, 480), "white").save(buf, format="PNG")
img = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
prompt = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Find x.<|im_end|>\n<|im_start|>assistant\n"
req = {"text": prompt, "image_data": img, "sampling_params": {"max_new_tokens": 8, "temperature": 1.0}}
r = json.loads(urllib.request.urlopen(urllib.request.Request("http://localhost:31000/generate", json.dumps(req).encode(), {"Content-Type": "application/json"}), timeout=120).read())
print("generate:", {k: r["meta_info"].get(k) for k in ("prompt_tokens", "completion_tokens", "finish_reason")})
PY
tail -5 $R/sglang.log | cut -c1-300
pkill -f sglang.launch_server; sleep 2
