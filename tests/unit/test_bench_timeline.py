"""The train-gpu bench's idle accounting (`idle_gaps`), on activity intervals built here, its
phase times and its variant names."""

import pytest

from vlmrl.bench.train_gpu import MARKER_KERNEL, idle_gaps, phase_host_ms, vlmrl_variant_options


def test_idle_gaps_counts_overlap_once_and_splits_at_the_marker():
    acts = [
        (100.0, 110.0, "gemm"),
        (105.0, 120.0, "copy"),          # overlaps the GEMM: covered time counted once
        (150.0, 160.0, "norm"),          # 30 us idle before it
        (162.0, 163.0, MARKER_KERNEL),   # 2 us idle, below the listed minimum; forward ends here
        (200.0, 260.0, "gemm_bwd"),      # 37 us idle, in the backward
        (210.0, 220.0, "inside"),        # inside the previous activity: no gap, no busy time
    ]
    r = idle_gaps(list(reversed(acts)), MARKER_KERNEL)
    assert r["span_us"] == pytest.approx(160.0)
    assert r["busy_us"] == pytest.approx(20 + 10 + 1 + 60)
    assert r["idle_us"] == pytest.approx(30 + 2 + 37)
    assert r["busy_us"] + r["idle_us"] == pytest.approx(r["span_us"])
    assert r["forward_span_us"] == pytest.approx(62.0) and r["forward_idle_us"] == pytest.approx(32.0)
    assert [(g["gap_us"], g["after"], g["before"]) for g in r["gaps"]] == [
        (pytest.approx(37.0), MARKER_KERNEL, "gemm_bwd"), (pytest.approx(30.0), "copy", "norm")]
    assert r["gaps"][1]["at_us"] == pytest.approx(20.0)


def test_idle_gaps_without_a_marker_or_activity():
    assert idle_gaps([], MARKER_KERNEL)["idle_us"] == 0.0
    r = idle_gaps([(0.0, 5.0, "a"), (5.0, 9.0, "b")], MARKER_KERNEL)
    assert r["idle_us"] == 0.0 and r["busy_us"] == pytest.approx(9.0) and "forward_span_us" not in r


def test_kernels_are_grouped_by_kind_from_their_names():
    """Real kernel names from H200 timelines fall into the kinds the bench reports."""
    from vlmrl.bench.train_gpu import kernel_kind

    names = {
        "_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm6kernel13GemmUniversal":
            "grouped GEMM",
        "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT": "GEMM",
        "sm80_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize128x64x8_stage3": "GEMM",
        "triton_red_fused__log_softmax__log_softmax_backward_data__to_copy_2": "softmax / log-softmax (loss)",
        "void at::native::(anonymous namespace)::cunn_SoftMaxBackward<4, float, float, float>":
            "softmax / log-softmax (loss)",
        "triton_red_fused__to_copy_gather_logsumexp_squeeze_sub_unsqueeze_0": "softmax / log-softmax (loss)",
        "triton_poi_fused__to_copy_add_arange_eq_exp_sub_unsqueeze_0": "softmax / log-softmax (loss)",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26": "attention",
        "tilelang_fused_chunk_gdr_bwd_kernel_kernel": "Gated DeltaNet (fla / FlashQLA)",
        "causal_conv1d_bwd_kernel": "short convolution",
        "short_conv_bwd": "short convolution",
        "lse_partials": "softmax / log-softmax (loss)",
        "logits_grad": "softmax / log-softmax (loss)",
        "void at::native::(anonymous namespace)::conv_depthwise2d_forward_kernel_generic": "short convolution",
        "triton_per_fused__to_copy_add_index_select_mul_sigmoid_sum_unsqueeze_view_10":
            "gather / scatter / sort (MoE dispatch and combine, embedding)",
        "void at_cuda_detail::cub::detail::radix_sort::DeviceRadixSortOnesweepKernel":
            "gather / scatter / sort (MoE dispatch and combine, embedding)",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::x>":
            "multi-tensor (optimizer: Adam, grad norm and scale)",
        # Megatron's per-parameter main_grad.add_(grad): float32 += bf16 (H200, 2026-12-05)
        "void at::native::unrolled_elementwise_kernel<at::native::CUDAFunctor_add<float>, std::array<char*, 3ul>, "
        "4, TrivialOffsetCalculator<2, unsigned int>, TrivialOffsetCalculator<1, unsigned int>, "
        "at::native::memory::LoadWithCast<2>, at::native::memory::StoreWithCast<1> >":
            "gradient accumulation (bf16 into fp32 main grads)",
        # a float32 add without the cast is not an accumulation of gradients
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, std::array<char*, 3ul> >":
            "other eager elementwise / reductions",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
        "TensorListMetadata<2>, at::native::(anonymous namespace)::UnaryOpFunctor<c10::BFloat16, 2, 1, 1>, "
        "at::native::Copy<c10::BFloat16, c10::BFloat16> >": "foreach copies (CUDA graph inputs)",
        "Memcpy DtoD (Device -> Device)": "copies and fills",
        "void at::native::vectorized_elementwise_kernel<8, at::native::bfloat16_copy_kernel_cuda>": "copies and fills",
        "triton_poi_fused_mul_silu_split_8": "other compiled (Inductor)",
        "void at::native::elementwise_kernel<128, 4, at::native::BinaryFunctor<float>>":
            "other eager elementwise / reductions",
        "spin_kernel": "other",
    }
    assert {n: kernel_kind(n) for n in names} == names


def test_summarize_reads_a_saved_timeline(tmp_path, capsys):
    """`--summarize` reads a saved chrome trace: span, busy and idle time, and GPU time by
    kind summed over kernels (host events are ignored)."""
    import gzip
    import json

    from vlmrl.bench.train_gpu import main

    events = [{"ph": "X", "cat": "kernel", "name": "nvjet_a", "ts": 0, "dur": 100},
              {"ph": "X", "cat": "kernel", "name": "nvjet_b", "ts": 150, "dur": 50},
              {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 200, "dur": 10},
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500}]
    path = tmp_path / "timeline-1-x.json.gz"
    path.write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
    assert main(["--summarize", str(path)]) == 0
    out = capsys.readouterr().out
    rows = {line.rsplit(None, 1)[0].strip(): float(line.rsplit(None, 1)[1]) for line in out.splitlines()[1:]}
    assert rows == {"step span (ms)": 0.21, "GPU busy (ms)": 0.16, "GPU idle (ms)": 0.05, "GEMM": 0.15,
                    "copies and fills": 0.01}


def test_ratios_to_the_row_before_and_to_the_first_hf_row():
    """Interleaved pairs (hf, vlmrl, hf, vlmrl): each vlmrl row against the HF row just
    before it, and against the run's first HF row (a later HF instance in the same process
    can be slower); rows before any HF row get None."""
    from vlmrl.bench.train_gpu import add_ratios

    def row(variant, tps, b2b):
        return {"variant": variant, "tokens_per_s": tps, "tokens_per_s_back_to_back": b2b}

    rows = [row("vlmrl_x", 50.0, 60.0), row("hf_x", 100.0, 100.0), row("vlmrl_x", 180.0, 190.0),
            row("hf_x", 80.0, 90.0), row("vlmrl_x", 176.0, 198.0)]
    add_ratios(rows)
    got = [(r["vs_hf"], r["vs_hf_back_to_back"], r["vs_first_hf"], r["vs_first_hf_back_to_back"]) for r in rows]
    assert got == [(None, None, None, None), (1.0, 1.0, 1.0, 1.0), (1.8, 1.9, 1.8, 1.9),
                   (1.0, 1.0, 0.8, 0.9), (2.2, 2.2, 1.76, 1.98)]


def test_a_pair_on_other_token_layouts_is_refused():
    """Both sides of a pair train the same [samples, tokens per sample]; HF's one causal row of
    every token against vlmrl's packed samples (the bench before 2026-12-05) is refused."""
    import torch

    from vlmrl.bench.train_gpu import add_ratios, token_layout

    def row(variant, layout):
        return {"variant": variant, "tokens_per_s": 1.0, "tokens_per_s_back_to_back": 1.0, "token_layout": layout}

    ids = torch.arange(4096)
    assert token_layout(ids, 8) == [8, 512] and token_layout(ids, 1) == [1, 4096]
    with pytest.raises(ValueError, match="does not split"):
        token_layout(ids, 3)
    add_ratios([row("hf_x", [8, 512]), row("vlmrl_x", [8, 512])])
    with pytest.raises(ValueError, match="not a pair on equal work"):
        add_ratios([row("hf_x", [1, 4096]), row("vlmrl_x", [8, 512])])


@pytest.mark.parametrize("variant,graphs,attention", [
    ("vlmrl_megatron_fused", False, "sdpa"),
    ("vlmrl_megatron_fused_graphs", True, "sdpa"),
    ("vlmrl_megatron_fused_graphs_flash4", True, "flash4"),
    ("vlmrl_qwen35_moe_flash4", False, "flash4"),
])
def test_vlmrl_variant_names_pick_graphs_and_attention(variant, graphs, attention):
    assert vlmrl_variant_options(variant) == {"cuda_graphs": graphs, "attention": attention}


def test_trainer_steps_names_what_compiled_again():
    """The trainer-steps bench keeps Dynamo's recompile messages: the function and the guard
    that failed (here an int argument first compiled as a constant)."""
    import torch

    from vlmrl.bench.trainer_steps import recompile_log

    messages = recompile_log()
    try:
        def scaled(x, n: int):
            return x * n

        f = torch.compile(scaled)
        f(torch.ones(4), 2)
        assert messages == []  # a first compile is no recompile
        f(torch.ones(4), 3)
        assert len(messages) == 1
        assert "Recompiling function scaled" in messages[0] and "n == 2" in messages[0]
    finally:
        torch._logging.set_logs()  # torch's logging as it was (the handler only fills the list)


def test_phase_host_ms_keeps_the_host_range_of_each_phase():
    """A CUDA profile lists each trainer phase twice: its host range, then its span on the GPU
    with no host time. The host range counts, whatever the order; other ops are left out."""
    rows = [("vlmrl.forward_backward", 732_506.0), ("aten::mm", 9_000.0), ("vlmrl.optimizer_step", 29_880.0),
            ("vlmrl.forward_backward", 0.0), ("vlmrl.optimizer_step", 0.0), ("vlmrl.metrics", 0.0),
            ("vlmrl.metrics", 33_302.0)]
    assert phase_host_ms(rows, steps=2) == {"vlmrl.forward_backward": pytest.approx(366.253),
                                             "vlmrl.optimizer_step": pytest.approx(14.94),
                                             "vlmrl.metrics": pytest.approx(16.651)}
