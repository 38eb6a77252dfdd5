"""Model specs: HF vision tower + Megatron language model, weight adapters.

Import-light on purpose (the dry-run path imports vlmrl.models): nothing here imports
torch or megatron. Modules:
- `bridge`: vlmrl ModelConfig -> Megatron TransformerConfig, per-layer-type specs, model build
- `qwen_vl`: the Megatron Qwen-VL module of one pipeline stage (HF ViT + GPTModel, M-RoPE)
- `attention`: packed (THD) core attention on torch SDPA / flash varlen, context parallel
- `mrope`: M-RoPE cos/sin tables and rotation (pure)
- `norm`: RMSNorm for the specs (HF numerics, sequence parallel)
- `kernels`: Inductor-fused twins of the elementwise functions (`hardware.fused_kernels`)
- `fused_layer`: the transformer layer whose dense body runs as two compiled graphs
- `adapters`: HF <-> Megatron weights (load, export, bucketed iteration for weight sync)
- `parity`: HF / cross-layout parity checks and their CLI (`python -m vlmrl.models.parity`)
- `names`, `processor`, `tiny`: HF names, processor loading, the tiny checkpoint
"""
