"""The Megatron Qwen-VL module of one pipeline stage: HF vision tower + Megatron GPT.

`QwenVLModel` holds
- `visual`: the HuggingFace vision tower (first pipeline stage only, replicated across
  tensor-parallel ranks), at its HF checkpoint parameter names (`visual.blocks.0...`);
- `language_model`: a megatron-core `GPTModel` built from a per-layer spec (see `bridge`),
  with no position embedding of its own: M-RoPE cos/sin tables are computed here from the
  packed [3, T] positions and handed to the packed core attention (`attention`).

The forward takes one `PackedSequence` (THD, one micro-batch, possibly one CP rank's
share) and the pixel values of all its images. On the first stage it embeds the tokens,
runs the vision tower and writes image features into the image placeholder rows; later
stages receive hidden states through `set_input_tensor` (Megatron's pipeline schedules).
The last stage returns logits [T, vocab / tp] (vocab-parallel); other stages return hidden
states [T, 1, hidden].
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core import tensor_parallel
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor

from . import compat
from .attention import VLPackedSeqParams
from .mrope import MRopeSpec, mrope_cos_sin
from .packing import PackedSequence, check_image_tokens, image_token_count


class QwenVLModel(MegatronModule):
    def __init__(
        self,
        config: TransformerConfig,
        block_spec: Any,
        *,
        vocab_size: int,
        max_sequence_length: int,
        rope: MRopeSpec,
        hf_vision_config: Any,
        tie_word_embeddings: bool,
        pre_process: bool = True,
        post_process: bool = True,
        vp_stage: int | None = None,
        vision_attn_implementation: str = "sdpa",
        vision_tower_class: type | None = None,
    ) -> None:
        super().__init__(config=config)
        self.model_type = ModelType.encoder_or_decoder  # read by Megatron's schedules
        self.pre_process = pre_process
        self.post_process = post_process
        self.vp_stage = vp_stage
        self.rope = rope
        self.language_model = GPTModel(
            config=config,
            transformer_layer_spec=block_spec,
            vocab_size=vocab_size,
            max_sequence_length=max_sequence_length,
            pre_process=pre_process,
            post_process=post_process,
            parallel_output=True,
            share_embeddings_and_output_weights=tie_word_embeddings,
            position_embedding_type="none",
            # image features go in before the sequence-parallel scatter (done here)
            scatter_embedding_sequence_parallel=False,
            vp_stage=vp_stage,
        )
        self.visual = build_vision_tower(hf_vision_config, vision_attn_implementation, config.params_dtype,
                                         vision_tower_class) if pre_process else None
        self.spatial_merge_size = int(getattr(hf_vision_config, "spatial_merge_size", 2))

    # Megatron's schedules hand the previous stage's output in here.
    def set_input_tensor(self, input_tensor: Any) -> None:
        self.language_model.set_input_tensor(input_tensor)

    # Read by Megatron's finalize_model_grads (tied embeddings across pipeline stages).
    @property
    def share_embeddings_and_output_weights(self) -> bool:
        return self.language_model.share_embeddings_and_output_weights

    def shared_embedding_or_output_weight(self) -> Any:
        return self.language_model.shared_embedding_or_output_weight()

    def packed_seq_params(self, packed: PackedSequence, device: torch.device) -> VLPackedSeqParams:
        # computed in float32, then cast once to the activations' dtype (as HF does)
        cos, sin = mrope_cos_sin(compat.to_device(packed.position_ids, device), self.rope, dtype=self.config.params_dtype)
        cu = compat.to_device(packed.cu_seqlens.to(torch.int32), device)
        cu_padded = compat.to_device(packed.cu_seqlens_padded.to(torch.int32), device)
        cp_group = None
        if packed.cp_size > 1:
            from megatron.core import parallel_state

            cp_group = parallel_state.get_context_parallel_group()
        return VLPackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded,
            cu_seqlens_kv_padded=cu_padded, max_seqlen_q=packed.max_seqlen, max_seqlen_kv=packed.max_seqlen,
            cp_group=cp_group, rope_cos=cos, rope_sin=sin, cp_size=packed.cp_size, cp_rank=packed.cp_rank,
            host_offsets=[int(x) for x in packed.cu_seqlens_padded.tolist()],
            parents=packed.parents, host_seq_lens=list(packed.seq_lens) if packed.parents is not None else None,
        )

    def _hand_engine_routing(self, packed: PackedSequence, device: torch.device) -> None:
        """Give this stage's MoE routers the engine's experts of the packed tokens, or None
        (`vlmrl.models.routing`; the router list is found once)."""
        found = self.__dict__.get("_engine_routers")
        if found is None:
            from .routing import routers

            found = self.__dict__["_engine_routers"] = routers(self)
        rows = packed.routed_experts
        if rows is not None:
            if not found:
                raise ValueError("the batch carries the engine's experts but the model has no MoE router")
            rows = compat.to_device(rows, device)
        for r in found:
            r.engine_rows = rows

    def embed(self, packed: PackedSequence, pixel_values: Tensor | None, device: torch.device) -> Tensor:
        """Token embeddings [T, 1, hidden] with image features in the placeholder rows."""
        n_here = int(packed.image_mask.sum())  # host side: no device sync
        input_ids = compat.to_device(packed.input_ids, device)
        emb = self.language_model.embedding(input_ids=input_ids.unsqueeze(0), position_ids=None)
        if packed.cp_size == 1:
            check_image_tokens(packed)
        if packed.num_image_tokens == 0:
            if n_here:
                raise ValueError(f"{n_here} image tokens but no images in the batch")
            return emb
        if pixel_values is None:
            raise ValueError(f"the batch has {packed.num_image_tokens} image tokens but no pixel_values")
        # each distinct image once: samples that share a prompt's image read the same rows
        grids = packed.vision_grids
        out = self.visual(pixel_values.to(device=device, dtype=self.visual.dtype), grid_thw=grids.to(device))
        feats = out.pooler_output if hasattr(out, "pooler_output") else out
        want = int(image_token_count(grids.cpu(), self.spatial_merge_size).sum()) if len(grids) else 0
        if feats.shape[0] != want:
            raise ValueError(f"the vision tower gave {feats.shape[0]} image features for the {want} image tokens "
                             f"of its grids {grids.tolist()}")
        if packed.image_token_index.numel() != n_here:
            raise ValueError(f"{n_here} image tokens here but image_token_index has "
                             f"{packed.image_token_index.numel()} rows")
        rows = feats.index_select(0, packed.image_token_index.to(device)).to(emb.dtype)
        # the prompts' placeholder rows (the image token's id in a response is text), found on the host
        where = compat.to_device(torch.nonzero(packed.image_mask).view(-1), device)
        return emb.index_put((where, torch.zeros_like(where)), rows)

    def forward(self, packed: PackedSequence, pixel_values: Tensor | None = None) -> Tensor:
        device = _module_device(self)
        params = self.packed_seq_params(packed, device)
        self._hand_engine_routing(packed, device)
        decoder_input = None
        if self.pre_process:
            decoder_input = self.embed(packed, pixel_values, device)
            if self.config.sequence_parallel:
                decoder_input = tensor_parallel.scatter_to_sequence_parallel_region(decoder_input)
        out = self.language_model(input_ids=None, position_ids=None, attention_mask=None,
                                  decoder_input=decoder_input, packed_seq_params=params)
        if self.post_process:
            return out.squeeze(0)  # [T, vocab / tp]
        return out


def build_vision_tower(hf_vision_config: Any, attn_implementation: str, dtype: torch.dtype,
                       cls: type | None) -> torch.nn.Module:
    """The HF vision tower (class `cls`, its family's: `families.*.vision_tower_class`)."""
    if cls is None:
        raise ValueError("build_vision_tower needs the vision tower class of the model's family")
    hf_vision_config._attn_implementation = attn_implementation
    return cls._from_config(hf_vision_config, dtype=dtype)


def _module_device(module: torch.nn.Module) -> torch.device:
    for p in module.parameters():
        return p.device
    return torch.device("cpu")
