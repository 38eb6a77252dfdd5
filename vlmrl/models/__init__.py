"""Model specs: HF vision tower + Megatron language model, weight adapters.

Import-light on purpose (the dry-run path imports vlmrl.models): nothing here imports
torch or megatron. Modules:
- `bridge`: vlmrl ModelConfig -> Megatron TransformerConfig, per-layer-type specs, model build
- `families/`: per-family wiring (Qwen2.5-VL; Qwen3.5 and Qwen3.5-MoE): HF configs and
  classes, layer specs, weight-mapping rules, checkpoint names
- `specs`: the ModuleSpecs of the layer parts (attention, Gated DeltaNet, MLP, MoE, layer)
- `qwen_vl`: the Megatron Qwen-VL module of one pipeline stage (HF ViT + GPTModel, M-RoPE)
- `attention`: packed (THD) core attention on torch SDPA / flash varlen, context parallel
- `gdn`, `gated_delta`: the Gated DeltaNet mixer (TP heads, CP all-to-all) and its maths
  (packed convolution and chunked recurrence in torch; fla kernels on GPUs, checked first)
- `short_conv`: the Gated DeltaNet's packed short convolution as Triton kernels (GPUs)
- `moe`: routed experts in HF's fused shapes for Megatron's MoELayer (grouped GEMM on GPUs)
- `routing`: the router told the rollout engine's experts (routing replay, mismatch metric)
- `grads`: gradient reductions beyond Megatron's (TP sums of head-shared weights)
- `mrope`: M-RoPE cos/sin tables and rotation (pure)
- `packing`: THD packing of samples, per-sample M-RoPE positions, the CP zigzag split (pure)
- `compat`: what makes megatron-core 0.16 run on CPU processes over gloo (shims)
- `norm`: RMSNorm for the specs (HF numerics, zero-centred gamma, sequence parallel)
- `kernels`: Inductor-fused twins of the elementwise functions (`hardware.fused_kernels`)
- `fused_layer`: the transformer layer whose dense body runs as two compiled graphs
- `adapters`: HF <-> Megatron weights (load, export, bucketed iteration for weight sync)
- `rules`, `names`, `processor`, `tiny`: weight-mapping rules, HF names, processor loading,
  the tiny checkpoints
"""
