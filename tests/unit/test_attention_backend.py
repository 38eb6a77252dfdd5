"""The language model's attention backends: FlashAttention 4's setting without its package,
and the startup check that holds a fast backend to the explicit masked softmax."""

from __future__ import annotations

import pytest
import torch


def test_flash4_backend_without_its_package_says_what_to_install():
    """`hardware.lm_attention_backend=flash4` builds its attention with FlashAttention 4
    (`flash_attn.cute`, GPU-only); where that does not import, building the layer fails
    naming the setting and the package, instead of falling back silently."""
    try:
        import flash_attn.cute  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("FlashAttention 4 is installed here")
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from vlmrl.models.attention import PackedSelfAttentionCore

    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                            kv_channels=16, attention_dropout=0.0)
    with pytest.raises(ImportError, match="lm_attention_backend=flash4.*flash-attn-4"):
        PackedSelfAttentionCore(cfg, 1, AttnMaskType.causal, backend="flash4")
    PackedSelfAttentionCore(cfg, 1, AttnMaskType.causal, backend="sdpa")


def test_attention_check_passes_sdpa_and_is_cached():
    """The check runs the backend's packed causal attention forward and backward against the
    explicit softmax in float32: torch SDPA agrees to float32 rounding, and in bf16 to
    within its bound; the second call at the same shape returns the cached result."""
    from vlmrl.models import attention

    cpu = torch.device("cpu")
    worst = attention.check_attention_backend("sdpa", heads=4, groups=2, head_dim=16, device=cpu, dtype=torch.float32)
    assert 0.0 < worst < 1e-5
    bf16 = attention.check_attention_backend("sdpa", heads=4, groups=2, head_dim=16, device=cpu, dtype=torch.bfloat16)
    assert 1e-4 < bf16 <= attention.ATTENTION_CHECK_TOL[torch.bfloat16]
    key = ("sdpa", 4, 2, 16, "cpu", torch.bfloat16, attention.ATTENTION_CHECK_LENS)
    assert attention._ATTENTION_CHECKED[key] == bf16


def test_attention_check_refuses_a_backend_outside_its_bound(monkeypatch):
    """Held to a bound tighter than bf16 rounding, the same bf16 run fails, and the error names
    the backend, what differs, the shape and the setting to fall back to."""
    from vlmrl.models import attention

    monkeypatch.setitem(attention.ATTENTION_CHECK_TOL, torch.bfloat16, 1e-6)
    monkeypatch.setattr(attention, "_ATTENTION_CHECKED", {})
    with pytest.raises(attention.AttentionBackendError,
                       match=r"'sdpa' disagrees.*output differs.*3 heads, 1 KV groups of 8.*lm_attention_backend=sdpa"):
        attention.check_attention_backend("sdpa", heads=3, groups=1, head_dim=8, device=torch.device("cpu"),
                                          dtype=torch.bfloat16)


def test_flash4_graph_layout_keeps_recorded_graphs_to_a_few_layouts():
    """Inside a CUDA graph, FlashAttention 4's sample offsets and longest length key the
    recording: the offsets are padded with empty samples to a power-of-two count, the longest
    sample rounded up to a power of two (at least one row tile, at most the row)."""
    from vlmrl.models.flash4 import MIN_GRAPH_MAX_LEN, graph_layout

    assert graph_layout([0, 37, 337, 1337, 2037, 4096]) == ([0, 37, 337, 1337, 2037, 4096, 4096, 4096], 4096)
    assert graph_layout([0, 4096]) == ([0, 4096], 4096)
    assert graph_layout([0, 10, 20]) == ([0, 10, 20, 20], 20)  # never past the row
    assert graph_layout([0, 100, 200, 300, 1000]) == ([0, 100, 200, 300, 1000, 1000, 1000, 1000], 1000)
    assert graph_layout([0, 100, 150, 2048]) == ([0, 100, 150, 2048], 2048)
    assert graph_layout([0] + [64 * (i + 1) for i in range(64)])[1] == MIN_GRAPH_MAX_LEN
    # RL-like micro-batches of one 8192-token bucket: many layouts, few keys
    import random

    rng = random.Random(0)
    keys = set()
    for _ in range(500):
        cuts = sorted(rng.sample(range(1, 8192), rng.randint(0, 40)))
        offsets, max_len = graph_layout([0, *cuts, 8192])
        keys.add((len(offsets), max_len))
    assert len(keys) <= 7 * 7, keys
    for bad in ([5, 10], [0], [0, 10, 5]):
        with pytest.raises(ValueError, match="offsets"):
            graph_layout(bad)


def test_gpu_benches_train_with_the_hopper_default_where_flash4_is_installed(capsys):
    """The weight-sync and trainer-steps benches build the trainer from `hardware=h200`, which
    trains attention with FlashAttention 4: where it does not import they fall back to sdpa
    and say why (the import's own error); the config they load (as they load it) carries the
    backend they time."""
    from vlmrl.bench.weight_sync import trainer_overrides
    from vlmrl.config import load
    from vlmrl.models import flash4

    overrides = trainer_overrides("cuda", "bfloat16")
    said = capsys.readouterr().err
    if flash4.installed():
        assert said == ""
    else:
        assert "flash_attn.cute" in said and flash4.missing() in said and "sdpa" in said
    assert ("hardware.lm_attention_backend=sdpa" in overrides) == (not flash4.installed())
    cfg = load(overrides, check_rules=False)
    assert cfg.hardware.lm_attention_backend == ("flash4" if flash4.installed() else "sdpa")
    assert "hardware.lm_attention_backend=sdpa" not in trainer_overrides("cpu", "float32")


def test_startup_checks_compare_relative_to_the_reference_and_stop_at_nan():
    """The comparison behind both startup checks (attention, Gated DeltaNet): the largest
    difference relative to the reference's largest magnitude; the first pair past the bound,
    NaN included, is named."""
    from vlmrl.models.reference_check import worst_relative

    want = torch.tensor([1.0, -4.0])
    worst, bad = worst_relative([("a", want + 0.04, want), ("b", want, want)], 2e-2)
    assert bad is None and abs(worst - 0.01) < 1e-6
    worst, bad = worst_relative([("a", want, want), ("b", want + 0.2, want), ("c", want * 9, want)], 2e-2)
    assert bad == ("b", worst) and abs(worst - 0.05) < 1e-6
    worst, bad = worst_relative([("a", torch.tensor([float("nan"), 0.0]), want)], 2e-2)
    assert bad is not None and bad[0] == "a" and worst != worst


@pytest.mark.parametrize("grouped", [True, False])
def test_shared_prompt_attention_equals_each_reply_attending_after_its_prompt(grouped):
    """Shared prompts (`PackedSequence.parents`): the replies read the prompt's keys and values
    and their own, causally, in one masked call per prompt (CPU) or one call per reply (CUDA);
    outputs and gradients equal attention over each whole sample (prompt + reply)."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from vlmrl.models.attention import PackedSelfAttentionCore, VLPackedSeqParams

    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                            kv_channels=16, attention_dropout=0.0)
    core = PackedSelfAttentionCore(cfg, 1, AttnMaskType.causal, backend="sdpa")
    core.shared_grouped = grouped
    prompt, replies, alone = 7, [3, 5, 1], 4
    g = torch.Generator().manual_seed(0)
    qkv = [torch.randn(prompt + sum(replies) + alone, h, 16, generator=g, dtype=torch.float64)
           for h in (4, 2, 2)]
    shared_lens = [prompt, *replies, alone]
    offsets = [0]
    for n in shared_lens:
        offsets.append(offsets[-1] + n)
    params = VLPackedSeqParams(qkv_format="thd", host_offsets=offsets, parents=[-1, 0, 0, 0, -1],
                               host_seq_lens=shared_lens)
    leaves = [x.clone().requires_grad_(True) for x in qkv]
    got = core.attend(*leaves, params)
    weights = torch.randn(got.shape, generator=g, dtype=got.dtype)
    (got * weights).sum().backward()
    # the same as whole samples: the prompt repeated before each reply
    rows = []
    for i, n in enumerate(replies):
        rows += [list(range(prompt)), list(range(offsets[i + 1], offsets[i + 1] + n))]
    rows.append(list(range(offsets[-2], offsets[-1])))
    index = torch.tensor([r for part in rows for r in part])
    whole_lens = [prompt + n for n in replies] + [alone]
    whole_offsets = [0]
    for n in whole_lens:
        whole_offsets.append(whole_offsets[-1] + n)
    whole = [x.detach().index_select(0, index).requires_grad_(True) for x in qkv]
    want = core.attend(*whole, VLPackedSeqParams(qkv_format="thd", host_offsets=whole_offsets))
    # the shared layout's rows in the whole layout: the first copy of the prompt, each reply, the sample alone
    keep = list(range(prompt))
    for i, n in enumerate(replies):
        keep += list(range(whole_offsets[i] + prompt, whole_offsets[i] + prompt + n))
    keep += list(range(whole_offsets[-2], whole_offsets[-1]))
    assert torch.allclose(got, want[keep], atol=1e-12)
    # the whole layout's loss with the shared weights; the prompt's copies carry the first copy's outputs
    whole_weights = torch.zeros_like(want)
    whole_weights[keep] = weights
    (want * whole_weights).sum().backward()
    for leaf, w in zip(leaves, whole):
        grad = torch.zeros_like(leaf).index_add_(0, index, w.grad)
        assert torch.allclose(leaf.grad, grad, atol=1e-12)
