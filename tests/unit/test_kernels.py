"""The Inductor-fused kernels (hardware.fused_kernels) against their plain definitions.

Compiled here with Inductor's CPU backend in float32: the same graphs the GPU configs
compile for Triton. Values and gradients must agree to float32 rounding, including when
the token count changes (the graphs are shape-generic in it from the first compile).
"""

from __future__ import annotations

import pytest
import torch

from vlmrl.models.kernels import fused, pick
from vlmrl.models.mrope import MRopeSpec, mrope_cos_sin, rope_qk
from vlmrl.models.norm import rms_norm
from vlmrl.training.logprobs import fused_log_softmax_pick, log_softmax_pick, logprobs_and_entropy


def _grads(fn, *inputs):
    leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    out = fn(*leaves)
    outs = [o for o in (out if isinstance(out, tuple) else (out,)) if o is not None]
    torch.manual_seed(1)
    loss = sum((o * torch.randn_like(o)).sum() for o in outs)
    loss.backward()
    return outs, [x.grad for x in leaves if x.requires_grad]


def _assert_close(a, b, tol=1e-5):
    for x, y in zip(a, b, strict=True):
        assert torch.allclose(x, y, atol=tol, rtol=tol), (x - y).abs().max().item()


def test_pick_returns_the_plain_function_unless_fused():
    assert pick(rms_norm, False) is rms_norm
    assert pick(rms_norm, True) is fused(rms_norm)  # one compiled twin per process


def _swish_gate(x: torch.Tensor, gate: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(gate) * w


def test_a_new_token_count_compiles_nothing_new():
    """The first compile is generic in the token dim (activations marked dynamic, parameters
    not): in training every micro-batch has another length, and none may recompile."""
    import torch._dynamo.utils

    graphs = torch._dynamo.utils.counters["stats"]
    w = torch.nn.Parameter(torch.randn(24))
    seen = []
    for tokens in (9, 31, 17, 64):
        x, gate = torch.randn(tokens, 24, requires_grad=True), torch.randn(tokens, 24)
        before = graphs["unique_graphs"]
        out = fused(_swish_gate)(x, gate, w)
        out.sum().backward()
        seen.append(graphs["unique_graphs"] - before)
        assert torch.allclose(out, _swish_gate(x, gate, w), atol=1e-6)
    assert seen == [1, 0, 0, 0]


@pytest.mark.parametrize("zero_centered", [False, True])
def test_fused_rms_norm_matches_plain(zero_centered):
    for tokens in (7, 13):  # a second token count: the same shape-generic graph
        x = torch.randn(tokens, 1, 48) * 3
        w = torch.randn(48) * 0.1 + (0.0 if zero_centered else 1.0)
        fn = lambda x, w: rms_norm(x, w, 1e-6, zero_centered)  # noqa: E731
        fused_fn = lambda x, w: fused(rms_norm)(x, w, 1e-6, zero_centered)  # noqa: E731
        (o1, g1), (o2, g2) = _grads(fn, x, w), _grads(fused_fn, x, w)
        _assert_close(o1, o2)
        _assert_close(g1, g2)


@pytest.mark.parametrize("rotary_dim", [16, 8])  # full and partial rotary
def test_fused_rope_matches_plain(rotary_dim):
    spec = MRopeSpec(head_dim=16, rotary_dim=rotary_dim, theta=1e4,
                     mrope_section=(rotary_dim // 4, rotary_dim // 8, rotary_dim // 8))
    for tokens in (9, 21):
        pos = torch.randint(0, 50, (3, tokens))
        cos, sin = mrope_cos_sin(pos, spec)
        q, k = torch.randn(tokens, 4, 16), torch.randn(tokens, 2, 16)
        fn = lambda q, k, cos=cos, sin=sin: rope_qk(q, k, cos, sin)  # noqa: E731
        fused_fn = lambda q, k, cos=cos, sin=sin: fused(rope_qk)(q, k, cos, sin)  # noqa: E731
        (o1, g1), (o2, g2) = _grads(fn, q, k), _grads(fused_fn, q, k)
        _assert_close(o1, o2)
        _assert_close(g1, g2)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_log_softmax_matches_plain_and_the_sharded_path(temperature):
    for tokens in (5, 11):
        logits = torch.randn(tokens, 257) * 4
        targets = torch.randint(0, 257, (tokens,))
        fn = lambda x, t=targets: log_softmax_pick(x, t, temperature, True)  # noqa: E731
        fused_fn = lambda x, t=targets: logprobs_and_entropy(x, t, temperature=temperature, fused=True)  # noqa: E731
        (o1, g1), (o2, g2) = _grads(fn, logits), _grads(fused_fn, logits)
        _assert_close(o1, o2)
        _assert_close(g1, g2)
        # the definition itself: log_softmax of the tempered logits, entropy of that distribution
        ref = torch.log_softmax(logits / temperature, -1)
        assert torch.allclose(o1[0], ref.gather(-1, targets[:, None])[:, 0], atol=1e-6)
        assert torch.allclose(o1[1], -(ref.exp() * ref).sum(-1), atol=1e-5)


def test_hand_written_log_softmax_backward_is_autograds():
    """`fused_log_softmax_pick`'s backward (elementwise given the forward's lse and entropy)
    is the gradient of its forward: torch's gradcheck in float64, with the entropy's gradient
    and without it (an entropy only logged), at a temperature other than 1."""
    torch.manual_seed(0)
    logits = (torch.randn(4, 9, dtype=torch.float64) * 3).requires_grad_()
    targets = torch.randint(0, 9, (4,))
    for temperature in (1.0, 0.6):
        both = lambda x, t=temperature: fused_log_softmax_pick(x, targets, t, True, compiled=False)  # noqa: E731
        assert torch.autograd.gradcheck(both, (logits,))
        only_logp = lambda x, t=temperature: fused_log_softmax_pick(x, targets, t, True, compiled=False)[0]  # noqa: E731
        assert torch.autograd.gradcheck(only_logp, (logits,))
        logp, entropy = fused_log_softmax_pick(logits, targets, temperature, True, compiled=False)
        ref = log_softmax_pick(logits, targets, temperature, True)
        assert torch.allclose(logp, ref[0]) and torch.allclose(entropy, ref[1])


def test_fused_log_softmax_without_entropy_reads_no_entropy_gradient():
    """Compiled (Inductor's CPU backend): logprobs only, and the entropy computed but not in
    the loss, give the plain function's logprob gradient."""
    for tokens in (6, 10):
        logits = torch.randn(tokens, 131) * 5
        targets = torch.randint(0, 131, (tokens,))
        weights = torch.randn(tokens)
        grads = []
        for fn, entropy in ((log_softmax_pick, False), (fused_log_softmax_pick, False),
                            (fused_log_softmax_pick, True)):
            x = logits.clone().requires_grad_()
            logp, _ = fn(x, targets, 0.8, entropy)
            (logp * weights).sum().backward()
            grads.append(x.grad)
        assert torch.allclose(grads[0], grads[1], atol=1e-6) and torch.allclose(grads[0], grads[2], atol=1e-6)


def test_fused_gated_delta_elementwise_match_plain():
    """The Gated DeltaNet layer's elementwise steps (hardware.fused_kernels compiles both): the
    decay g and beta from a, b, A_log, dt_bias, and the gated RMSNorm (float32 norm weight, as
    checkpoints store it, on bf16-shaped activations here kept in float32)."""
    from vlmrl.models.gated_delta import decay_and_beta, gated_rms_norm

    for tokens in (6, 19):
        a, b = torch.randn(tokens, 4), torch.randn(tokens, 4)
        a_log, dt_bias = torch.rand(4) * 2, torch.randn(4)
        (o1, g1), (o2, g2) = (_grads(decay_and_beta, a, b, a_log, dt_bias),
                              _grads(fused(decay_and_beta), a, b, a_log, dt_bias))
        _assert_close(o1, o2)
        _assert_close(g1, g2)
        x, gate, w = torch.randn(tokens, 4, 16) * 2, torch.randn(tokens, 4, 16), torch.randn(16) * 0.2 + 1
        fn = lambda x, gate, w: gated_rms_norm(x, gate, w, 1e-6)  # noqa: E731
        fused_fn = lambda x, gate, w: fused(gated_rms_norm)(x, gate, w, 1e-6)  # noqa: E731
        (o1, g1), (o2, g2) = _grads(fn, x, gate, w), _grads(fused_fn, x, gate, w)
        _assert_close(o1, o2)
        _assert_close(g1, g2)


def test_fused_kernel_inputs_match_plain_on_views_of_the_convolution_output():
    """The q / k l2 norm and the copies before fla's kernels (`kernel_inputs`, compiled on a
    GPU): q, k, v come in as strided views of one [T, heads * (2 dk + r dv)] tensor, as
    `GatedDeltaNet.recurrence` splits them, and come out contiguous, q and k of unit norm."""
    from vlmrl.models.gated_delta import kernel_inputs

    hk, dk, r, dv = 2, 8, 2, 4
    for tokens in (5, 23):
        mixed = torch.randn(tokens, hk * (2 * dk + r * dv)) * 3

        def split(mixed):
            q, k, v = mixed.view(-1, hk, 2 * dk + r * dv).split([dk, dk, r * dv], dim=-1)
            return q, k, v.reshape(-1, hk * r, dv)

        plain = lambda m: kernel_inputs(*split(m))  # noqa: E731
        compiled = lambda m: fused(kernel_inputs)(*split(m))  # noqa: E731
        (o1, g1), (o2, g2) = _grads(plain, mixed), _grads(compiled, mixed)
        _assert_close(o1, o2)
        _assert_close(g1, g2)
        q, k, v = o2
        assert all(t.is_contiguous() for t in o2)
        assert torch.allclose(q.norm(dim=-1), torch.ones(tokens, hk), atol=1e-5)
        assert torch.allclose(k.norm(dim=-1), torch.ones(tokens, hk), atol=1e-5)
        assert torch.equal(v, split(mixed)[2])


def test_fused_kernels_reach_the_gated_delta_layers():
    from megatron.core.transformer.spec_utils import ModuleSpec

    from vlmrl.config import load
    from vlmrl.models.families import qwen3_5

    model = load(["model=tiny_qwen3_5_moe"], check_rules=False).model
    for flag in (False, True):
        mixer = qwen3_5.layer_spec(model, "linear_attention", fused_kernels=flag).submodules.self_attention
        assert isinstance(mixer, ModuleSpec) and mixer.params["fused"] is flag


def test_compile_caches_live_under_the_run_cache_and_the_users_settings_win():
    """`hardware.compile_cache_dir` puts Inductor's, Triton's, TileLang's and FlashAttention 4's
    kernels, and the SGLang servers' (tvm-ffi, flashinfer and DeepGEMM JIT kernels, SGLang's
    own cache), under one folder and turns FA4's disk cache on (off by default: every process
    compiled its kernels again); a variable the user set is left alone; "" sets nothing."""
    from vlmrl.config import load
    from vlmrl.models.kernels import COMPILE_CACHE_VARS, compile_cache_env

    root = load(["model.cache_dir=/data/vlmrl"]).hardware.compile_cache_dir
    assert root == "/data/vlmrl/compile"
    env = compile_cache_env(root, environ={})
    assert env["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] == "1"
    assert {env[k] for k in COMPILE_CACHE_VARS} == {f"{root}/{sub}" for sub in COMPILE_CACHE_VARS.values()}
    assert len(set(COMPILE_CACHE_VARS.values())) == len(COMPILE_CACHE_VARS)  # one folder each
    assert {"TVM_FFI_CACHE_DIR", "FLASHINFER_WORKSPACE_BASE", "SGLANG_DG_CACHE_DIR", "SGLANG_CACHE_DIR"} <= set(env)
    mine = compile_cache_env(root, environ={"TRITON_CACHE_DIR": "/scratch/triton"})
    assert "TRITON_CACHE_DIR" not in mine and mine["TORCHINDUCTOR_CACHE_DIR"] == f"{root}/inductor"
    assert compile_cache_env("", environ={}) == {}
    # Inductor writes its default folder into the environment at its first compile (so a
    # process that compiled anything passes it on): that is torch's choice, not the user's
    import os

    from torch._inductor.runtime.cache_dir_utils import cache_dir

    @torch.compile
    def double(x):
        return x * 2

    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
        double(torch.ones(3))
        written = os.environ["TORCHINDUCTOR_CACHE_DIR"]
        assert written == cache_dir()
        assert compile_cache_env(root)["TORCHINDUCTOR_CACHE_DIR"] == f"{root}/inductor"
        mp.setenv("TORCHINDUCTOR_CACHE_DIR", "/scratch/inductor")  # the user's own: left alone
        assert "TORCHINDUCTOR_CACHE_DIR" not in compile_cache_env(root)


def test_the_training_bench_says_how_warm_its_compile_cache_was(tmp_path, monkeypatch):
    """The bench's processes use the run's compile cache too, and its result records how many
    files each cache held before the first compile (0 on a fresh machine)."""
    from vlmrl.bench.train_gpu import compile_cache
    from vlmrl.models.kernels import COMPILE_CACHE_VARS

    for var in [*COMPILE_CACHE_VARS, "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"]:
        monkeypatch.delenv(var, raising=False)  # restored (unset) after the test
    (tmp_path / "inductor" / "fx").mkdir(parents=True)
    (tmp_path / "inductor" / "fx" / "graph").write_text("x")
    got = compile_cache(str(tmp_path))
    assert got["files_at_start"] == {"TORCHINDUCTOR_CACHE_DIR": 1, **{var: 0 for var in COMPILE_CACHE_VARS
                                                                        if var != "TORCHINDUCTOR_CACHE_DIR"}}
    import os

    assert os.environ["TILELANG_CACHE_DIR"] == str(tmp_path / "tilelang")
