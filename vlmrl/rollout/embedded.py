"""The embedded engine: an HF transformers VLM with its own decode loop, the CPU default.

`EmbeddedEngine` loads a checkpoint with `AutoModelForImageTextToText` and the project's
`load_processor` (same pixel bounds as training), and generates with a KV cache:

* Requests are batched with LEFT padding. Each request's 3D M-RoPE positions are computed
  from its own unpadded tokens (`get_rope_index` for prompts with images, arange for
  text) and placed under its tokens; pad slots are masked out. Decode positions continue
  from max(prompt positions) + 1 per row (Qwen's rope delta), so nothing in a row depends
  on its batch companions: no shared `rope_deltas` state on the model is used.
* Identical prompts in one batch (a GRPO group's samples) are prefilled once: each of their
  rows then decodes from a copy of that prefill's cache rows, as SGLang serves them from one
  cached prefix. Image features are computed per distinct prompt and scattered over its
  image tokens.
* Logprobs follow the contract in `protocol.py`: log_softmax(logits.float() / T) at the
  sampled token, T = temperature (1 for greedy); top-p / top-k only restrict sampling.
* Each request samples with its own torch.Generator (seeded by `sampling.seed`), so a
  seeded request gives the same tokens whatever else is in its batch.
* With `return_routed_experts` (MoE models) a request also gets the experts every decoder
  layer routed each of its tokens to (the prompt's in the prefill, each fed-back sampled
  token's in its decode step; the last sampled token is never fed), read from the routers'
  outputs by forward hooks, in SGLang's wire form (`protocol.encode_routed_experts`).
* Rows that finish leave the batch (their cache rows are dropped: attention KV, and the
  convolution and recurrent states of Gated DeltaNet layers in Qwen3.5's hybrid cache).
  Left padding is exact for Gated DeltaNet layers too: transformers zeroes padded inputs, so
  a padded row's convolution and recurrent state start at zero as an unpadded one's do.

Batch invariance holds up to floating-point rounding: CPU GEMMs reduce differently for
different batch sizes (e.g. gemv for one row), so logprobs of a request in different
batches agree to ~1e-6 in fp32, not bit for bit (tests check <= 1e-5 and identical
greedy tokens).

`generate` (async) feeds a micro-batcher: concurrent callers (the HTTP server, the
rollout manager) are coalesced into batches of at most `max_batch_size`. Every torch call of
the engine (the model's load, the batches, weight copies, release and resume) runs on one
thread of its own: on a CPU, parallel torch work started from two threads keeps two OpenMP
thread teams, whose idle threads spin on the cores the working team needs (on two cores a
batch of the MoE miniature took 2.4 s instead of 1.4 s once the model had been loaded on
another thread than the one generating). A batch waits for more callers while requests keep
arriving (`batch_wait_s` of quiet ends the wait, `batch_max_wait_s` bounds it). `load()`
counts the requests in the batch being generated ("running") and those queued for one
("waiting"), which the HTTP server reports on /v1/loads. A request while memory
is released, or a weight update while the weights are, is refused and counted in `stats`.
`EmbeddedEngineActor` / `create_embedded_actor` put the engine in a Ray actor (its HTTP
server speaking the protocol of the SGLang release `sglang_version`) and `RayEngine` is the
`Engine` view of such an actor.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import logging
import math
import random
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .faults import KILL_ENGINE_ON_RELEASE_ENV, KILL_ENGINE_ON_SYNC_ENV, KillSwitch
from .protocol import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    EngineError,
    GenerateRequest,
    GenerateResult,
    SamplingParams,
    bucketize,
    encode_routed_experts,
    memory_tags,
)
from .weights import copy_grouped

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- images
def load_image(src: Any, *, timeout_s: float = 10.0) -> Any:
    """A PIL RGB image from a request's image entry (data URI, URL, file path, bytes, PIL).

    SGLang also accepts bare base64 strings; so does this. Failures are non-retryable
    request errors (HTTP 400)."""
    from ..data.images import ImageError, decode_image

    if isinstance(src, str) and not src.startswith(("data:", "http://", "https://", "file://")) \
            and not Path(src).exists():
        try:
            src = base64.b64decode(src, validate=True)
        except ValueError as e:
            raise EngineError(f"cannot read image {src[:60]!r}", retryable=False, status=400) from e
    try:
        return decode_image(src, timeout_s=timeout_s)
    except ImageError as e:
        raise EngineError(str(e), retryable=False, status=400) from e


# --------------------------------------------------------------------------- engine
@dataclass
class _Prepared:
    key: Any
    ids: Any  # LongTensor [L] (image tokens expanded)
    positions: Any  # LongTensor [3, L]
    next_position: int  # position of the first generated token
    pixel_values: Any | None
    image_grid_thw: Any | None

    @property
    def length(self) -> int:
        return int(self.ids.shape[0])


@dataclass
class _Row:
    index: int  # position in the batch's request list
    params: SamplingParams
    generator: Any
    out_ids: list[int]
    logprobs: list[float]
    finish: str | None = None
    matched: int | str | None = None
    experts: list[Any] | None = None  # [tokens, layers, k] blocks of routed experts, when asked for
    rid: str | None = None


def moe_routers(model: Any) -> list[tuple[int, Any]]:
    """(decoder layer index, router module) of every MoE layer of a transformers model: the
    `layers.<i>.mlp.gate` modules with a top-k (vision blocks are `blocks.<i>`)."""
    import re

    out = []
    for name, module in model.named_modules():
        m = re.search(r"(?:^|\.)layers\.(\d+)\.mlp\.gate$", name)
        if m and hasattr(module, "top_k") and hasattr(module, "num_experts"):
            out.append((int(m.group(1)), module))
    return out


def _dtype(name: str) -> Any:
    import torch

    return {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
            "float16": torch.float16, "fp16": torch.float16}[str(name)]


class EmbeddedEngine:
    """HF transformers engine implementing the `Engine` protocol (see module docstring)."""

    def __init__(
        self,
        model_path: str,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        max_batch_size: int = 64,
        name: str = "embedded-0",
        attn_implementation: str = "sdpa",
        batch_wait_s: float = 0.015,
        batch_max_wait_s: float = 0.1,
        prompt_cache_size: int = 1024,
        model: Any = None,
        processor: Any = None,
    ) -> None:
        import torch
        import transformers

        from ..models.processor import load_processor

        self.name = name
        self.model_path = str(model_path)
        self.device = torch.device(device)
        self.dtype = _dtype(dtype)
        self.max_batch_size = int(max_batch_size)
        self.batch_wait_s = float(batch_wait_s)
        self.batch_max_wait_s = float(batch_max_wait_s)
        self.processor = processor or load_processor(self.model_path, min_pixels=min_pixels, max_pixels=max_pixels)
        self.tokenizer = self.processor.tokenizer
        # the one thread of every torch call (module docstring)
        self._torch_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{name}-torch")
        self._torch_ident = self._torch_thread.submit(threading.get_ident).result()

        def place(model: Any) -> Any:
            if model is None:
                model = transformers.AutoModelForImageTextToText.from_pretrained(
                    self.model_path, dtype=self.dtype, attn_implementation=attn_implementation)
            model = model.to(self.device).eval()
            for p in model.parameters():
                p.requires_grad_(False)
            return model

        self.model = self._on_torch_thread(place, model)
        # checkpoint name -> the tensor a weight update copies into (a parameter, or a slice of
        # a fused one), resolved at its first update: resolving every name in every sync is
        # host time; forgotten when the weights move to or from the host
        self._targets: dict[str, Any] | None = None
        cfg = self.model.config
        self.image_token_id = int(cfg.image_token_id)
        self.image_token = self.tokenizer.convert_ids_to_tokens(self.image_token_id)
        self.merge_size = int(cfg.vision_config.spatial_merge_size)
        text_cfg = getattr(cfg, "text_config", cfg)
        self.context_length = int(getattr(text_cfg, "max_position_embeddings", None) or 1 << 30)
        self.vocab_size = int(getattr(text_cfg, "vocab_size", None) or self.model.get_output_embeddings().weight.shape[0])
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        eos: set[int] = set()
        if self.tokenizer.eos_token_id is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        gen_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if gen_eos is not None:
            eos.update(int(t) for t in (gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos]))
        im_end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        if isinstance(im_end, int) and im_end != self.tokenizer.unk_token_id:
            eos.add(im_end)
        self.eos_token_ids = frozenset(eos)
        # transformers 5.2x renamed forward's `past_key_values` to `cache` (old name deprecated)
        import inspect

        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        # MoE routers by decoder layer, and what their forwards routed while capturing
        self._routers = moe_routers(self.model)
        self.num_layers = int(getattr(text_cfg, "num_hidden_layers", 0) or 0)
        self._routed: dict[int, Any] | None = None
        for layer, router in self._routers:
            router.register_forward_hook(self._router_hook(layer))
        self.weight_version = "0"
        self.released_tags: set[str] = set()  # memory given up (colocated training)
        self.kill_switch = KillSwitch.from_env()
        self.release_kill_switch = KillSwitch.from_env(KILL_ENGINE_ON_RELEASE_ENV)
        self.sync_kill_switch = KillSwitch.from_env(KILL_ENGINE_ON_SYNC_ENV)
        self._lock = threading.Lock()  # one batch (or weight update) at a time
        self._prompt_cache: OrderedDict[Any, _Prepared] = OrderedDict()
        self._prompt_cache_size = int(prompt_cache_size)
        self._batcher: _Batcher | None = None
        # requests queued for the batcher / taken from it or given to generate_sync but not yet
        # in a batch / in the batch being generated (what /v1/loads reports)
        self._load_lock = threading.Lock()
        self._queued = self._pending = self._running = 0
        # ids of requests asked to stop (abort_requests) that have not finished yet; guarded
        # by _load_lock, read by the decode loop between steps
        self._aborted: set[str] = set()
        self._live: set[str] = set()  # ids of requests taken and not finished
        self.stats = {"batches": 0, "requests": 0, "generated_tokens": 0, "prefilled_prompts": 0,
                      "refused_generate_released": 0, "refused_update_released": 0}

    # ----------------------------------------------------------------- the torch thread
    def _on_torch_thread(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """fn(*args, **kwargs) on the engine's torch thread, waited for (called directly there)."""
        if threading.get_ident() == self._torch_ident:
            return fn(*args, **kwargs)
        return self._torch_thread.submit(fn, *args, **kwargs).result()

    async def torch_call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """fn(*args, **kwargs) on the engine's torch thread, awaited from an event loop (the
        HTTP server decodes and receives weight payloads there too)."""
        return await asyncio.get_running_loop().run_in_executor(self._torch_thread,
                                                                functools.partial(fn, *args, **kwargs))

    # ----------------------------------------------------------------- preparation
    def _prepare(self, req: GenerateRequest) -> _Prepared:
        import torch

        key = (req.text, req.input_ids, req.images)
        hit = self._prompt_cache.get(key)
        if hit is not None:
            self._prompt_cache.move_to_end(key)
            return hit
        images = [load_image(s) for s in req.images]
        pixel_values = grid = None
        if req.text is not None:
            n_placeholders = req.text.count(self.image_token)
            if n_placeholders != len(images):
                raise EngineError(
                    f"prompt text has {n_placeholders} image placeholders ({self.image_token}) "
                    f"but {len(images)} images were sent", retryable=False, status=400)
            enc = self.processor(text=[req.text], images=images or None, return_tensors="pt")
            ids = enc["input_ids"][0]
            if images:
                pixel_values, grid = enc["pixel_values"], enc["image_grid_thw"]
        else:
            ids = torch.tensor(req.input_ids, dtype=torch.long)
            if images:
                enc = self.processor.image_processor(images=images, return_tensors="pt")
                pixel_values, grid = enc["pixel_values"], enc["image_grid_thw"]
                counts = (grid.prod(-1) // self.merge_size**2).tolist()
                n_tok = int((ids == self.image_token_id).sum())
                if n_tok == len(images) and sum(counts) != n_tok:
                    parts, k = [], 0
                    for t in ids.tolist():
                        if t == self.image_token_id:
                            parts.extend([t] * counts[k])
                            k += 1
                        else:
                            parts.append(t)
                    ids = torch.tensor(parts, dtype=torch.long)
                elif n_tok != sum(counts):
                    raise EngineError(f"input_ids hold {n_tok} image tokens; {len(images)} images need "
                                      f"{len(images)} placeholders or {sum(counts)} expanded tokens",
                                      retryable=False, status=400)
        if ids.numel() == 0:
            raise EngineError("empty prompt", retryable=False, status=400)
        if ids.numel() >= self.context_length:
            raise EngineError(f"the prompt has {ids.numel()} tokens; the model's context is {self.context_length}",
                              retryable=False, status=400)
        if grid is not None:
            mm = (ids == self.image_token_id).long()[None]
            pos, _ = self.model.model.get_rope_index(ids[None], mm_token_type_ids=mm, image_grid_thw=grid)
            positions = pos[:, 0].cpu()
        else:
            positions = torch.arange(ids.numel()).view(1, -1).expand(3, -1)
        prep = _Prepared(key, ids, positions, int(positions.max()) + 1, pixel_values, grid)
        self._prompt_cache[key] = prep
        while len(self._prompt_cache) > self._prompt_cache_size:
            self._prompt_cache.popitem(last=False)
        return prep

    # ----------------------------------------------------------------- decode loop
    def _image_features(self, prep: _Prepared) -> Any:
        import torch

        out = self.model.model.get_image_features(prep.pixel_values.to(self.device), prep.image_grid_thw.to(self.device))
        return torch.cat(list(out.pooler_output), dim=0)

    def _sample(self, logits: Any, rows: list[_Row]) -> tuple[list[int], list[float]]:
        import torch

        x = logits.float()
        temps = torch.tensor([r.params.logprob_temperature for r in rows], dtype=torch.float32, device=x.device)
        logp = torch.log_softmax(x / temps[:, None], dim=-1)
        tokens: list[int] = []
        for i, r in enumerate(rows):
            p = r.params
            if p.greedy:
                tokens.append(int(torch.argmax(logp[i])))
                continue
            lp = logp[i]
            if p.top_k and 0 < p.top_k < lp.numel():
                kth = torch.topk(lp, p.top_k).values[-1]
                lp = lp.masked_fill(lp < kth, -math.inf)
            if p.top_p < 1.0:
                sorted_lp, order = torch.sort(lp, descending=True)
                probs = sorted_lp.exp()
                drop = (probs.cumsum(-1) - probs) > p.top_p  # keeps the first token always
                lp = lp.clone()
                lp[order[drop]] = -math.inf
            probs = torch.softmax(lp, dim=-1)
            tokens.append(int(torch.multinomial(probs, 1, generator=r.generator)))
        idx = torch.tensor(tokens, device=x.device)
        chosen = logp.gather(1, idx[:, None])[:, 0].tolist()
        return tokens, chosen

    def _check_finish(self, r: _Row) -> None:
        t = r.out_ids[-1]
        p = r.params
        if not p.ignore_eos and t in self.eos_token_ids:
            r.finish, r.matched = FINISH_STOP, t
        elif t in p.stop_token_ids:
            r.finish, r.matched = FINISH_STOP, t
        elif p.stop:
            longest = max(len(s) for s in p.stop)
            tail = self.tokenizer.decode(r.out_ids[-(longest + 8):], skip_special_tokens=True)
            for s in p.stop:
                if s in tail:
                    r.finish, r.matched = FINISH_STOP, s
                    break
        if r.finish is None and len(r.out_ids) >= p.max_new_tokens:
            r.finish = FINISH_LENGTH

    def _text(self, r: _Row) -> str:
        ids = r.out_ids[:-1] if isinstance(r.matched, int) and r.out_ids else r.out_ids
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if isinstance(r.matched, str):
            pos = text.find(r.matched)
            if pos >= 0:
                text = text[:pos]
        return text

    def _make_generator(self, seed: int | None) -> Any:
        import torch

        g = torch.Generator(device=self.device)
        g.manual_seed(int(seed) if seed is not None else random.SystemRandom().randrange(1 << 62))
        return g

    # ----------------------------------------------------------------- routed experts
    def _router_hook(self, layer: int) -> Any:
        def hook(module: Any, args: Any, output: Any) -> None:
            if self._routed is not None:
                self._routed[layer] = output[-1]  # transformers' routers: (logits, weights, indices)
        return hook

    def _take_routed(self, tokens: int) -> Any:
        """The experts of the forward just run, [tokens, layers, k] on the host (-1 in layers
        without a router)."""
        import torch

        k = int(self._routers[0][1].top_k)
        out = torch.full((tokens, self.num_layers, k), -1, dtype=torch.int32)
        for layer, idx in (self._routed or {}).items():
            out[:, layer] = idx.reshape(tokens, k).to("cpu", torch.int32)
        self._routed = {}
        return out

    def _run_batch(self, preps: list[_Prepared], params: list[SamplingParams],
                   want_experts: Sequence[bool] = (), rids: Sequence[str | None] = ()) -> list[_Row]:
        """Prefill each distinct prompt of the batch once (a GRPO group's samples are the same
        prompt n times: SGLang serves them from one cached prefix), then give every row its
        prompt's cache rows and decode the rows together."""
        import torch
        from transformers import DynamicCache

        dev = self.device
        # identical requests share one `_Prepared` (the prompt cache): each distinct one is a prefill row
        firsts: list[_Prepared] = []
        row_of: dict[int, int] = {}
        of_row = []
        for p in preps:
            if id(p) not in row_of:
                row_of[id(p)] = len(firsts)
                firsts.append(p)
            of_row.append(row_of[id(p)])
        U, P = len(firsts), max(p.length for p in preps)
        self.stats["prefilled_prompts"] += U
        ids = torch.full((U, P), self.pad_id, dtype=torch.long)
        mask = torch.zeros((U, P), dtype=torch.long)
        pos = torch.zeros((3, U, P), dtype=torch.long)
        for i, p in enumerate(firsts):
            L = p.length
            ids[i, P - L:] = p.ids
            mask[i, P - L:] = 1
            pos[:, i, P - L:] = p.positions
        ids, mask, pos = ids.to(dev), mask.to(dev), pos.to(dev)
        embeds = self.model.get_input_embeddings()(ids)
        feats: dict[Any, Any] = {}
        for i, p in enumerate(firsts):
            if p.pixel_values is None:
                continue
            if p.key not in feats:
                feats[p.key] = self._image_features(p)
            where = ids[i] == self.image_token_id
            embeds[i, where] = feats[p.key].to(embeds.dtype)
        rows = [_Row(i, sp, self._make_generator(sp.seed), [], [], rid=rids[i] if rids else None)
                for i, sp in enumerate(params)]
        for r in rows:
            if r.params.max_new_tokens <= 0:
                r.finish = FINISH_LENGTH
        capture = bool(self._routers) and any(want_experts)
        self._routed = {} if capture else None
        cache = DynamicCache(config=self.model.config)
        try:
            out = self.model(inputs_embeds=embeds, attention_mask=mask, position_ids=pos, use_cache=True,
                             logits_to_keep=1, **{self._cache_kw: cache})
            logits = out.logits[:, -1]
            if U < len(preps):  # every row takes its prompt's cache rows (attention KV, GDN states)
                idx = torch.tensor(of_row, device=dev)
                for layer in cache.layers:
                    layer.reorder_cache(idx)
                logits, mask = logits[idx], mask[idx]
            if capture:
                routed = self._take_routed(U * P).view(U, P, self.num_layers, -1)
                for r, p, u, want in zip(rows, preps, of_row, want_experts):
                    if want:
                        r.experts = [routed[u, P - p.length:]]
            self._decode(rows, preps, logits, mask, cache, capture)
        finally:
            self._routed = None
        return rows

    def _decode(self, rows: list[_Row], preps: list[_Prepared], logits: Any, mask: Any, cache: Any,
                capture: bool) -> None:
        """Sample until every row has finished, feeding each step's tokens back."""
        import torch

        dev = self.device
        cur_pos = torch.tensor([p.next_position for p in preps], dtype=torch.long, device=dev)
        live = list(rows)
        tokens: list[int] = []
        while True:
            self._stop_aborted(live)
            keep = [k for k, r in enumerate(live) if r.finish is None]
            if not keep:
                break
            if len(keep) < len(live):  # finished rows leave the batch
                idx = torch.tensor(keep, device=dev)
                for layer in cache.layers:  # attention KV, or GDN conv + recurrent states
                    layer.reorder_cache(idx)
                live = [live[k] for k in keep]
                logits, mask, cur_pos = logits[idx], mask[idx], cur_pos[idx]
                tokens = [tokens[k] for k in keep] if tokens else tokens
            if tokens:  # feed the tokens sampled last step
                mask = torch.cat([mask, torch.ones((mask.shape[0], 1), dtype=mask.dtype, device=dev)], dim=1)
                step_ids = torch.tensor(tokens, dtype=torch.long, device=dev)[:, None]
                out = self.model(input_ids=step_ids, attention_mask=mask,
                                 position_ids=cur_pos.view(1, -1, 1).expand(3, -1, 1), use_cache=True,
                                 logits_to_keep=1, **{self._cache_kw: cache})
                logits = out.logits[:, -1]
                cur_pos = cur_pos + 1
                if capture:
                    routed = self._take_routed(len(live))
                    for j, r in enumerate(live):
                        if r.experts is not None:
                            r.experts.append(routed[j:j + 1])
            tokens, lps = self._sample(logits, live)
            for r, t, lp in zip(live, tokens, lps):
                r.out_ids.append(t)
                r.logprobs.append(lp)
                self._check_finish(r)

    # ----------------------------------------------------------------- abort
    def _stop_aborted(self, rows: Sequence[_Row]) -> None:
        """Rows whose request was aborted finish now, with what they generated so far."""
        with self._load_lock:
            if not self._aborted:
                return
            for r in rows:
                if r.finish is None and r.rid is not None and r.rid in self._aborted:
                    r.finish = FINISH_ABORT

    def _track(self, requests: Sequence[GenerateRequest], *, live: bool) -> None:
        """Requests taken (live) or finished (no longer live, nor aborted)."""
        rids = [q.rid for q in requests if q.rid is not None]
        with self._load_lock:
            if live:
                self._live.update(rids)
            else:
                self._live.difference_update(rids)
                self._aborted.difference_update(rids)

    def _is_aborted(self, rid: str | None) -> bool:
        with self._load_lock:
            return rid is not None and rid in self._aborted

    async def abort_requests(self, rids: Sequence[str]) -> None:
        """Stop the requests `rids`: a queued one finishes without running, a running one at
        its next decode step, both with finish_reason "abort" (as SGLang's /abort_request).
        Ids of requests this engine does not hold are ignored."""
        with self._load_lock:
            hit = [rid for rid in rids if rid in self._live and rid not in self._aborted]
            self._aborted.update(hit)
            self.stats["aborted"] = self.stats.get("aborted", 0) + len(hit)

    # ----------------------------------------------------------------- load
    def load(self) -> dict[str, int]:
        """Requests being generated ("running": the batch in the decode loop) and waiting for
        a batch ("waiting": queued in the batcher, or taken and not yet run)."""
        with self._load_lock:
            return {"running": self._running, "waiting": self._queued + self._pending}

    def _count(self, *, queued: int = 0, pending: int = 0, running: int | None = None) -> None:
        with self._load_lock:
            self._queued += queued
            self._pending += pending
            if running is not None:
                self._running = running

    # ----------------------------------------------------------------- sync API
    def generate_sync(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult | BaseException]:
        """Run requests now (in chunks of max_batch_size); a failed request's slot holds its
        exception, so one bad request does not fail its companions."""
        self._track(requests, live=True)
        return self._on_torch_thread(self._generate, requests, from_queue=False)

    def _generate(self, requests: Sequence[GenerateRequest], *, from_queue: bool) -> list[GenerateResult | BaseException]:
        import torch

        n = len(requests)
        self._count(queued=-n if from_queue else 0, pending=n)  # one step: never counted in neither
        left = n
        try:
            if self.released:
                # SGLang 0.5.17 crashed on this; the engine refuses it (HTTP 503) and counts it
                self.stats["refused_generate_released"] += n
                err = EngineError(f"engine memory is released ({sorted(self.released_tags)}); call "
                                  "resume_memory_occupation first")
                return [err for _ in requests]
            results: list[GenerateResult | BaseException | None] = [None] * n
            with self._lock, torch.inference_mode():
                prepared: list[tuple[int, _Prepared]] = []
                for i, req in enumerate(requests):
                    try:
                        prepared.append((i, self._prepare(req)))
                    except BaseException as e:  # noqa: BLE001 (reported per request)
                        results[i] = e if isinstance(e, EngineError) else EngineError(f"preprocessing failed: {e!r}")
                # similar lengths together: less padding (results do not depend on grouping)
                prepared.sort(key=lambda ip: ip[1].length)
                self._count(pending=-(n - len(prepared)))
                left = len(prepared)
                for s in range(0, len(prepared), self.max_batch_size):
                    chunk = prepared[s:s + self.max_batch_size]
                    self._count(pending=-len(chunk), running=len(chunk))
                    left -= len(chunk)
                    for i, prep in chunk:  # aborted while waiting: never run
                        if self._is_aborted(requests[i].rid):
                            results[i] = GenerateResult(output_ids=[], text="", logprobs=[] if requests[i].return_logprob
                                                        else None, finish_reason=FINISH_ABORT,
                                                        prompt_tokens=prep.length, rid=requests[i].rid,
                                                        weight_version=self.weight_version)
                    chunk = [(i, prep) for i, prep in chunk if results[i] is None]
                    if not chunk:
                        self._count(running=0)
                        continue
                    try:
                        rows = self._run_batch([p for _, p in chunk], [requests[i].sampling for i, _ in chunk],
                                               [requests[i].return_routed_experts for i, _ in chunk],
                                               [requests[i].rid for i, _ in chunk])
                    except Exception as e:  # noqa: BLE001
                        log.exception("embedded engine batch failed")
                        for i, _ in chunk:
                            results[i] = EngineError(f"generation failed: {e!r}")
                        continue
                    finally:
                        self._count(running=0)
                    self._finish(requests, chunk, rows, results)
            return results  # type: ignore[return-value]
        finally:
            self._count(pending=-left)
            self._track(requests, live=False)

    def _finish(self, requests: Sequence[GenerateRequest], chunk: list[tuple[int, _Prepared]], rows: list[_Row],
                results: list[GenerateResult | BaseException | None]) -> None:
        self.stats["batches"] += 1
        for (i, prep), r in zip(chunk, rows):
            req = requests[i]
            self.stats["requests"] += 1
            self.stats["generated_tokens"] += len(r.out_ids)
            results[i] = GenerateResult(
                output_ids=list(r.out_ids),
                text=self._text(r),
                logprobs=list(r.logprobs) if req.return_logprob else None,
                finish_reason=r.finish or FINISH_LENGTH,
                prompt_tokens=prep.length,
                matched_stop=r.matched,
                prompt_ids=prep.ids.tolist(),
                rid=req.rid,
                weight_version=self.weight_version,
                routed_experts=self._encode_experts(r),
            )

    @staticmethod
    def _encode_experts(r: _Row) -> str | None:
        if r.experts is None:
            return None
        import torch

        return encode_routed_experts(torch.cat(r.experts).reshape(-1).tolist())

    def load_named_tensors(self, named_tensors: Sequence[tuple[str, Any]]) -> None:
        """Copy tensors given by HF checkpoint names into the model (under the engine lock).

        A checkpoint tensor may be a slice of an in-memory parameter (Qwen3.5-MoE's routed
        experts: one tensor per expert on disk and on the wire, fused in memory)."""
        import torch

        from ..models import families

        if "weights" in self.released_tags:
            self.stats["refused_update_released"] += 1
            raise EngineError("the weights' memory is released; resume it (tags=['weights']) before "
                              "updating them", retryable=False, status=400)
        family = families.get(families.family_of_hf(self.model.config))
        with self._lock, torch.no_grad():
            if self._targets is None:
                self._targets = {}
            targets = self._targets
            params = None  # the state dict, walked only when a name was not resolved before
            dst, src = [], []
            for name, value in named_tensors:
                target = targets.get(name)
                if target is None:
                    if params is None:
                        params = self.model.state_dict(keep_vars=True)
                    module_name, index = family.module_slot(name)
                    target = params.get(module_name, params.get(name))
                    if target is None:
                        raise EngineError(f"unknown parameter {name!r}", retryable=False, status=400)
                    target = targets[name] = target.data if index is None else family.take(target.data, index)
                if target.shape != value.shape:
                    raise EngineError(f"shape mismatch for {name}: engine {tuple(target.shape)}, "
                                      f"sent {tuple(value.shape)}", retryable=False, status=400)
                if not isinstance(value, torch.Tensor) or value.dtype.is_floating_point != target.dtype.is_floating_point \
                        or value.is_complex() or value.dtype == torch.bool:
                    raise EngineError(f"dtype mismatch for {name}: engine {target.dtype}, sent "
                                      f"{getattr(value, 'dtype', type(value).__name__)}", retryable=False, status=400)
                dst.append(target)
                src.append(value)
            # every shape is checked before anything is copied: a bad bucket changes no weight
            copy_grouped(dst, src)
            self._prompt_cache.clear()

    # ----------------------------------------------------------------- Engine protocol
    def _get_batcher(self) -> _Batcher:
        loop = asyncio.get_running_loop()
        if self._batcher is None or self._batcher.loop is not loop or self._batcher.closed:
            self._batcher = _Batcher(self, loop)
        return self._batcher

    async def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        self._track(requests, live=True)  # an abort may come while they wait for a batch
        futures = self._get_batcher().submit(list(requests))
        if self.kill_switch is not None:  # fault injection (vlmrl.rollout.faults), tests only
            self.kill_switch.count(len(requests))
        return list(await asyncio.gather(*futures))

    async def update_weights_from_tensor(self, named_tensors: Sequence[tuple[str, Any]], *,
                                         bucket_bytes: int | None = None, flush_cache: bool = True,
                                         weight_version: str | None = None) -> None:
        for bucket in bucketize(named_tensors, bucket_bytes):
            await self.torch_call(self.load_named_tensors, bucket)
        if self.sync_kill_switch is not None:  # fault injection (vlmrl.rollout.faults), tests only
            self.sync_kill_switch.count(1)
        if weight_version is not None:
            self.weight_version = str(weight_version)

    @property
    def released(self) -> bool:
        return bool(self.released_tags)

    async def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        if self.release_kill_switch is not None:  # fault injection (vlmrl.rollout.faults), tests only
            self.release_kill_switch.count(1)
        await self.torch_call(self._release, memory_tags(tags))

    async def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        await self.torch_call(self._resume, memory_tags(tags))

    def _release(self, tags: tuple[str, ...]) -> None:
        """kv_cache: drop the prompt cache; weights: move the model to host memory (GPU);
        cuda_graph: nothing to free here (no graphs), but generation waits for it as SGLang's
        graph replay would."""
        import torch

        with self._lock:
            self.released_tags.update(tags)
            if "kv_cache" in tags:
                self._prompt_cache.clear()
            if "weights" in tags and self.device.type == "cuda":
                self.model.to("cpu")
                self._targets = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def _resume(self, tags: tuple[str, ...]) -> None:
        with self._lock:
            missing = [t for t in tags if t not in self.released_tags]
            if missing:  # SGLang fails the same way (it removes each tag from its released set)
                raise ValueError(f"cannot resume memory tags {missing}: not released "
                                 f"(released: {sorted(self.released_tags)})")
            if "weights" in tags and self.device.type == "cuda":
                self.model.to(self.device)
                self._targets = None
            self.released_tags.difference_update(tags)

    async def flush_cache(self) -> None:
        with self._lock:
            self._prompt_cache.clear()

    async def health(self) -> bool:
        return not self.released

    async def close(self) -> None:
        if self._batcher is not None:
            self._batcher.close()
            self._batcher = None

    def model_info(self) -> dict[str, Any]:
        return {"model_path": self.model_path, "tokenizer_path": self.model_path, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": self.weight_version,
                "has_image_understanding": True, "has_audio_understanding": False,
                "model_type": getattr(self.model.config, "model_type", None),
                "architectures": getattr(self.model.config, "architectures", None)}


class _Batcher:
    """Coalesces concurrent `generate` calls into batches run in a worker thread."""

    def __init__(self, engine: EmbeddedEngine, loop: asyncio.AbstractEventLoop) -> None:
        self.engine = engine
        self.loop = loop
        self.queue: asyncio.Queue[tuple[GenerateRequest, asyncio.Future]] = asyncio.Queue()
        self.closed = False
        self.task = loop.create_task(self._run())

    def submit(self, requests: list[GenerateRequest]) -> list[asyncio.Future]:
        futures = []
        for req in requests:
            fut = self.loop.create_future()
            self.queue.put_nowait((req, fut))
            futures.append(fut)
        self.engine._count(queued=len(requests))
        return futures

    def close(self) -> None:
        self.closed = True
        self.task.cancel()
        self._abandon([])  # requests never taken: no longer queued

    def _abandon(self, items: list[tuple[GenerateRequest, asyncio.Future]]) -> None:
        """Requests this batcher holds and will never run (its event loop is going away): no
        longer queued, nor live, and their callers are cancelled."""
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        self.engine._count(queued=-len(items))
        self.engine._track([r for r, _ in items], live=False)
        for _, f in items:
            if not f.done():
                f.cancel()

    async def _gather_arrivals(self) -> None:
        """Let concurrent callers join the batch: wait until no request has arrived for
        `batch_wait_s` (a rollout's requests come one call each, a few ms apart at times), the
        batch is full, or `batch_max_wait_s` has passed since the first."""
        e = self.engine
        end = self.loop.time() + e.batch_max_wait_s
        step = e.batch_wait_s / 3
        queued, quiet = self.queue.qsize(), 0
        while quiet < 3 and queued + 1 < e.max_batch_size and self.loop.time() < end:
            await asyncio.sleep(step)
            quiet = quiet + 1 if self.queue.qsize() == queued else 0
            queued = self.queue.qsize()

    async def _run(self) -> None:
        while True:
            first = await self.queue.get()
            try:
                await self._gather_arrivals()
            except asyncio.CancelledError:
                self._abandon([first])
                raise
            items = [first]
            while not self.queue.empty():
                items.append(self.queue.get_nowait())
            taken = len(items)
            gone = [r for r, f in items if f.done()]  # cancelled callers
            items = [(r, f) for r, f in items if not f.done()]
            self.engine._count(queued=-(taken - len(items)))
            self.engine._track(gone, live=False)
            if not items:
                continue
            try:
                results = await self.engine.torch_call(self.engine._generate, [r for r, _ in items], from_queue=True)
            except BaseException as e:  # noqa: BLE001
                results = [e] * len(items)
                if isinstance(e, asyncio.CancelledError):
                    for _, f in items:
                        if not f.done():
                            f.cancel()
                    raise
            for (_, fut), res in zip(items, results):
                if fut.done():
                    continue
                if isinstance(res, BaseException):
                    fut.set_exception(res)
                else:
                    fut.set_result(res)


# --------------------------------------------------------------------------- Ray
class EmbeddedEngineActor:
    """Ray actor body: one EmbeddedEngine, optionally serving SGLang's HTTP protocol."""

    def __init__(self, model_path: str, engine_kwargs: dict[str, Any] | None = None,
                 torch_threads: int | None = None, sglang_version: str | None = None) -> None:
        from ..contracts.sglang_contract import protocol
        from ..logging.console import quiet_from_env

        self.sglang_version = protocol(sglang_version).version  # an unknown release fails here, at once

        quiet_from_env()
        if torch_threads:  # Ray gives an actor with a fractional CPU request one thread
            import torch

            torch.set_num_threads(torch_threads)
        self.engine = EmbeddedEngine(model_path, **(engine_kwargs or {}))
        self._server: Any = None

    async def start_http(self, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None) -> str:
        """Serve the protocol of SGLang `sglang_version` (given at construction) for this
        engine; host "auto": this node's address; `api_key`: the run's engine key, required
        of every caller but /health (`vlmrl.rollout.auth`)."""
        from .server import start_server

        if host == "auto":
            import ray

            host = ray.util.get_node_ip_address()
        if self._server is None:
            self._server = await start_server(self.engine, host, port, sglang_version=self.sglang_version,
                                              api_key=api_key)
        return self._server.url

    async def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        return await self.engine.generate(requests)

    async def update_weights_from_tensor(self, named_tensors: list[tuple[str, Any]], bucket_bytes: int | None = None,
                                         flush_cache: bool = True, weight_version: str | None = None) -> None:
        await self.engine.update_weights_from_tensor(named_tensors, bucket_bytes=bucket_bytes,
                                                     flush_cache=flush_cache, weight_version=weight_version)

    async def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        await self.engine.release_memory_occupation(tags)

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        await self.engine.resume_memory_occupation(tags)

    async def flush_cache(self) -> None:
        await self.engine.flush_cache()

    async def abort_requests(self, rids: list[str]) -> None:
        await self.engine.abort_requests(rids)

    async def health(self) -> bool:
        return await self.engine.health()

    async def stats(self) -> dict[str, Any]:
        """The engine's counters and, once it serves HTTP, the server's (refusals counted)."""
        return {**self.engine.stats, **(self._server.stats if self._server is not None else {})}

    async def placement(self) -> dict[str, str]:
        """Where the engine computes: its device and the dtype of its weights."""
        return {"device": str(self.engine.device), "dtype": str(self.engine.dtype).removeprefix("torch.")}

    async def close(self) -> None:
        if self._server is not None:
            await self._server.close()
            self._server = None
        await self.engine.close()


def create_embedded_actor(model_path: str, *, num_cpus: float = 0.5, num_gpus: float = 0.0,
                          name: str = "embedded-0", scheduling_strategy: Any = None, torch_threads: int | None = None,
                          sglang_version: str | None = None, **engine_kwargs: Any) -> Any:
    """Start an `EmbeddedEngineActor` (Ray must be initialised); returns the actor handle.
    `scheduling_strategy`: e.g. its placement-group bundle; `torch_threads`: its CPU threads;
    `sglang_version`: the SGLang release whose protocol its HTTP server speaks
    (`rollout.embedded.sglang_version`; None: the newest vlmrl has a contract for)."""
    import ray

    from ..contracts.sglang_contract import protocol

    protocol(sglang_version)  # an unknown release fails here, before an actor starts
    cls = ray.remote(EmbeddedEngineActor)
    # Ray runs async actor methods concurrently on one event loop: the batcher coalesces them.
    return cls.options(num_cpus=num_cpus, num_gpus=num_gpus, max_concurrency=1000,
                       scheduling_strategy=scheduling_strategy).remote(model_path, {"name": name, **engine_kwargs},
                                                                       torch_threads, sglang_version)


class RayEngine:
    """The `Engine` protocol over an `EmbeddedEngineActor` handle."""

    def __init__(self, actor: Any, name: str = "embedded-0") -> None:
        self.actor = actor
        self.name = name

    async def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        return await self.actor.generate.remote(list(requests))

    async def update_weights_from_tensor(self, named_tensors: Sequence[tuple[str, Any]], *,
                                         bucket_bytes: int | None = None, flush_cache: bool = True,
                                         weight_version: str | None = None) -> None:
        # one actor call per bucket: bounds what sits in the object store at once
        for bucket in bucketize(named_tensors, bucket_bytes):
            await self.actor.update_weights_from_tensor.remote(bucket, None, flush_cache, None)
        if weight_version is not None:
            await self.actor.update_weights_from_tensor.remote([], None, flush_cache, weight_version)

    async def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        await self.actor.release_memory_occupation.remote(None if tags is None else list(memory_tags(tags)))

    async def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        await self.actor.resume_memory_occupation.remote(None if tags is None else list(memory_tags(tags)))

    async def flush_cache(self) -> None:
        await self.actor.flush_cache.remote()

    async def abort_requests(self, rids: Sequence[str]) -> None:
        await self.actor.abort_requests.remote(list(rids))

    async def health(self) -> bool:
        try:
            return bool(await self.actor.health.remote())
        except Exception:  # noqa: BLE001 (a dead actor is unhealthy)
            return False

    async def alive(self) -> bool:
        """Whether the actor's process answers (whatever its memory state)."""
        try:
            await self.actor.placement.remote()
            return True
        except Exception:  # noqa: BLE001
            return False

    async def close(self) -> None:
        try:
            await self.actor.close.remote()
        except Exception:  # noqa: BLE001
            pass

