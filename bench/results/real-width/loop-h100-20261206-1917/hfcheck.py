"""The real-width HF export (run A's hf/) in transformers and in SGLang 0.5.17:
greedy tokens of both on an image prompt and a text prompt, with SGLang's top-2 logprobs."""
import base64, io, json, os, subprocess, sys, time, urllib.request
import torch
from PIL import Image, ImageDraw

hf, out = sys.argv[1], sys.argv[2]
res = {"hf": hf}
img = Image.new("RGB", (512, 512), "white"); d = ImageDraw.Draw(img)
d.line([(60, 440), (450, 440), (250, 80), (60, 440)], fill="black", width=3); d.text((240, 450), "x", fill="black")
prompts = [("image", "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Find x.<|im_end|>\n<|im_start|>assistant\n"),
           ("text", "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")]
N = 16
mode = sys.argv[3] if len(sys.argv) > 3 else "both"
if mode == "sglang-only":  # the transformers half ran before (hfcheck.json); serve the same export in SGLang now
    res = json.load(open(f"{out}/hfcheck.json"))
from transformers import AutoModelForImageTextToText, AutoProcessor
t = time.time()
if mode != "sglang-only":
    net = AutoModelForImageTextToText.from_pretrained(hf, dtype=torch.bfloat16, device_map="cuda").eval()
    res["hf_load_s"] = time.time() - t
    res["hf_params_b"] = sum(p.numel() for p in net.parameters()) / 1e9
    res["hf_visual_keys"] = sum(1 for n, _ in net.named_parameters() if ".visual." in n)
    proc = AutoProcessor.from_pretrained(hf)
    res["transformers"] = {}
    for name, p in prompts:
        b = proc(text=[p], images=[img] if name == "image" else None, return_tensors="pt").to("cuda")
        with torch.no_grad():
            g = net.generate(**b, max_new_tokens=N, do_sample=False, output_scores=True, return_dict_in_generate=True)
        toks = g.sequences[0, b["input_ids"].shape[1]:].tolist()
        margins = []
        for s in g.scores:
            top = torch.topk(s[0].float().log_softmax(-1), 2).values
            margins.append(float(top[0] - top[1]))
        res["transformers"][name] = {"prompt_tokens": int(b["input_ids"].shape[1]), "tokens": toks, "top2_margins": margins}
    del net; torch.cuda.empty_cache()
else:
    proc = AutoProcessor.from_pretrained(hf)
if mode == "hf-only":
    json.dump(res, open(f"{out}/hfcheck.json", "w"), indent=1)
    print("transformers only:", res["hf_load_s"], res["hf_params_b"], {k: v["tokens"][:8] for k, v in res["transformers"].items()})
    sys.exit(0)
env = dict(os.environ, PYTHONPATH="/tmp/sglang-site", SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK="1")
log = open(f"{out}/hfcheck-sglang.log", "w")
srv = subprocess.Popen([sys.executable, "-m", "sglang.launch_server", "--model-path", hf, "--port", "31500",
                        "--mem-fraction-static", "0.5", "--attention-backend", "triton", "--mm-attention-backend",
                        "triton_attn", "--sampling-backend", "pytorch", "--disable-cuda-graph", "--log-level", "warning"],
                       env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
t = time.time()
while time.time() - t < 300:
    try:
        urllib.request.urlopen("http://localhost:31500/health", timeout=5); break
    except Exception:
        time.sleep(3)
res["sglang_ready_s"] = time.time() - t
buf = io.BytesIO(); img.save(buf, format="PNG")
data = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
res["sglang"] = {}
try:
    for name, p in prompts:
        req = {"text": p, "sampling_params": {"max_new_tokens": N, "temperature": 0.0},
               "return_logprob": True, "top_logprobs_num": 2}
        if name == "image":
            req["image_data"] = data
        r = json.loads(urllib.request.urlopen(urllib.request.Request("http://localhost:31500/generate", json.dumps(req).encode(),
                       {"Content-Type": "application/json"}), timeout=300).read())
        m = r["meta_info"]
        toks = [x[1] for x in m["output_token_logprobs"]]
        margins = [float(t2[0][0] - t2[1][0]) for t2 in m["output_top_logprobs"]]
        res["sglang"][name] = {"prompt_tokens": m["prompt_tokens"], "tokens": toks, "top2_margins": margins}
finally:
    os.killpg(srv.pid, 15)
for name, _ in prompts:
    a, b = res["transformers"][name]["tokens"], res["sglang"].get(name, {}).get("tokens", [])
    same = 0
    for x, y in zip(a, b):
        if x != y: break
        same += 1
    res.setdefault("agree", {})[name] = {"same_prefix": same, "of": N, "equal": a == b}
print(json.dumps(res["agree"]), res["hf_load_s"], res["hf_params_b"], res["sglang_ready_s"])
json.dump(res, open(f"{out}/hfcheck.json", "w"), indent=1)
