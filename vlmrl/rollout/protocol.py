"""The one engine protocol: requests, results, and what every rollout engine offers.

An *engine* is one inference server: an SGLang server (which may span several GPUs with
tensor / expert parallelism inside it) or the embedded HF transformers engine. A rollout
job holds a list of engines; the rollout manager spreads requests over them and weight
sync calls each of them. Every engine speaks the same async interface (`Engine`), and on
the wire both speak the same subset of SGLang's native HTTP protocol, translated here
(`request_to_sglang`, `result_from_sglang`, and their inverses for the embedded server).

Logprob contract (what `GenerateResult.logprobs` holds)
-------------------------------------------------------
For each generated token t_i, the engine reports

    logprob_i = log_softmax(logits_i.float() / T)[t_i]

where logits_i are the model's next-token logits given the prompt and t_<i, and T is the
request's temperature, with T := 1 for greedy decoding (temperature == 0). This is the same
quantity the trainer recomputes (`log_softmax(logits.float() / T)` at the sampled token),
so rollout and trainer logprobs differ only by numerics. `top_p` and `top_k` restrict
*which* tokens can be sampled; they do not renormalise the reported logprobs. (SGLang
reports logprobs of the temperature-scaled distribution before top-p/top-k filtering,
which is the same contract.)

Routed experts (MoE): with `return_routed_experts` the engine reports, for every token it
ran through the model (the prompt and the output but the last sampled token, which is never
fed back), the experts each decoder layer routed it to: SGLang's `meta_info.routed_experts`,
the base64 of little-endian int32 [tokens - 1, layers, top-k] (`decode_routed_experts`).

Outputs: `output_ids` includes the stop token when generation ended on EOS or a stop
token id (the trainer must learn to emit it), and `text` excludes it; when a stop string
matched, `text` is cut before the string (SGLang's default `no_stop_trim=False`) while
`output_ids` keeps every generated token. One logprob per output id.

This module imports only the standard library (plus torch lazily, for tensor buckets).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # pragma: no cover
    import torch

# SGLang's value of top_k meaning "no top-k" (TOP_K_ALL = 1 << 30); -1 means the same here.
TOP_K_ALL = 1 << 30

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"


class EngineError(RuntimeError):
    """A request or control call failed inside an engine (or on the way to it).

    `retryable` is False for errors that will fail again (a malformed request)."""

    def __init__(self, message: str, *, retryable: bool = True, status: int | None = None):
        super().__init__(message)
        self.retryable = retryable
        self.status = status


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. temperature 0 means greedy (argmax)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or <= 0): no top-k
    max_new_tokens: int = 128
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None  # per-request seed: same seed, same samples
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def logprob_temperature(self) -> float:
        """The T in log_softmax(logits / T): the temperature, or 1 for greedy."""
        return 1.0 if self.greedy else float(self.temperature)

    def to_sglang(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "temperature": float(self.temperature),
            "top_p": float(self.top_p),
            "top_k": int(self.top_k) if self.top_k and self.top_k > 0 else -1,
            "max_new_tokens": int(self.max_new_tokens),
        }
        if self.stop:
            out["stop"] = list(self.stop)
        if self.stop_token_ids:
            out["stop_token_ids"] = [int(t) for t in self.stop_token_ids]
        if self.seed is not None:
            out["sampling_seed"] = int(self.seed)
        if self.ignore_eos:
            out["ignore_eos"] = True
        return out

    @classmethod
    def from_sglang(cls, d: dict[str, Any] | None) -> SamplingParams:
        d = dict(d or {})
        stop = d.get("stop") or ()
        if isinstance(stop, str):
            stop = (stop,)
        top_k = int(d.get("top_k", -1) if d.get("top_k") is not None else -1)
        if top_k >= TOP_K_ALL:
            top_k = -1
        seed = d.get("sampling_seed", d.get("seed"))
        return cls(
            temperature=float(d.get("temperature", 1.0) if d.get("temperature") is not None else 1.0),
            top_p=float(d.get("top_p", 1.0) if d.get("top_p") is not None else 1.0),
            top_k=top_k,
            max_new_tokens=int(d.get("max_new_tokens", 128) if d.get("max_new_tokens") is not None else 128),
            stop=tuple(str(s) for s in stop),
            stop_token_ids=tuple(int(t) for t in (d.get("stop_token_ids") or ())),
            seed=None if seed is None else int(seed),
            ignore_eos=bool(d.get("ignore_eos", False)),
        )


@dataclass(frozen=True)
class GenerateRequest:
    """One prompt to complete: `text` (with the model's image placeholders, one per image,
    exactly as SGLang expects) or `input_ids`; images as data URIs, URLs or file paths."""

    text: str | None = None
    input_ids: tuple[int, ...] | None = None
    images: tuple[str, ...] = ()
    sampling: SamplingParams = field(default_factory=SamplingParams)
    return_logprob: bool = True
    rid: str | None = None
    return_routed_experts: bool = False

    def __post_init__(self) -> None:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("a GenerateRequest needs exactly one of text or input_ids")
        if self.input_ids is not None and not isinstance(self.input_ids, tuple):
            object.__setattr__(self, "input_ids", tuple(int(t) for t in self.input_ids))
        if not isinstance(self.images, tuple):
            object.__setattr__(self, "images", tuple(self.images))

    def replace(self, **changes: Any) -> GenerateRequest:
        return dataclasses.replace(self, **changes)


@dataclass
class GenerateResult:
    output_ids: list[int]
    text: str
    logprobs: list[float] | None  # one per output id (see the contract above)
    finish_reason: str  # "stop" | "length" | "abort"
    prompt_tokens: int
    matched_stop: int | str | None = None
    prompt_ids: list[int] | None = None  # the expanded prompt (image tokens included), when known
    rid: str | None = None
    weight_version: str | None = None
    # base64 of int32 [prompt + output - 1, layers, top-k] when asked for (see the module docstring)
    routed_experts: str | None = None

    @property
    def truncated(self) -> bool:
        return self.finish_reason == FINISH_LENGTH

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)


@runtime_checkable
class Engine(Protocol):
    """What the rollout manager and weight sync need from an engine (all async)."""

    name: str

    async def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        """Complete every request; results in request order. Raises EngineError if any fails."""
        ...

    async def update_weights_from_tensor(
        self,
        named_tensors: Sequence[tuple[str, torch.Tensor]],
        *,
        bucket_bytes: int | None = None,
        flush_cache: bool = True,
        weight_version: str | None = None,
    ) -> None:
        """Load new values for parameters given by HF *checkpoint* names, sent in buckets of
        at most `bucket_bytes` (one bucket = one engine call; None: one call)."""
        ...

    async def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """Give up device memory (colocated training): any of MEMORY_TAGS (`weights`,
        `kv_cache`, `cuda_graph`; None: all three, as in SGLang). Generation fails while
        any is released, weight updates while the weights are."""
        ...

    async def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """Take the memory of `tags` back (None: all three). Resuming a tag that is not
        released is an error, as in SGLang."""
        ...

    async def flush_cache(self) -> None: ...

    async def abort_requests(self, rids: Sequence[str]) -> None:
        """Stop generating the requests `rids` (SGLang's /abort_request): a queued one never
        runs, a running one finishes with finish_reason "abort". Unknown or finished ids are
        ignored. What the caller no longer needs stops costing engine time."""
        ...

    async def health(self) -> bool: ...

    async def close(self) -> None: ...


# --------------------------------------------------------------------------- memory
# SGLang's release/resume_memory_occupation tags (sglang/srt/constants.py). No tags (null or
# an empty list) means every one of them, on release and on resume alike: a colocated
# engine that was released without tags must get the CUDA graphs' memory back too, or the
# next graph replay reads freed memory.
MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")
# (The colocated hand-over of these tags between phases: vlmrl.cluster.colocation.)


def memory_tags(tags: Sequence[str] | None) -> tuple[str, ...]:
    """The tags a release/resume call covers (None or empty: all, as in SGLang); unknown
    tags raise ValueError naming them."""
    if not tags:
        return MEMORY_TAGS
    if isinstance(tags, str):
        raise ValueError(f"memory tags must be a list of strings, not the string {tags!r}")
    unknown = [t for t in tags if t not in MEMORY_TAGS]
    if unknown:
        raise ValueError(f"unknown memory tags {unknown}; known: {list(MEMORY_TAGS)}")
    return tuple(dict.fromkeys(tags))


# --------------------------------------------------------------------------- buckets
def tensor_nbytes(t: Any) -> int:
    return int(t.numel()) * int(t.element_size())


def bucketize(named_tensors: Iterable[tuple[str, Any]], bucket_bytes: int | None) -> Iterator[list[tuple[str, Any]]]:
    """Split (name, tensor) pairs into consecutive buckets of at most `bucket_bytes` bytes.

    A tensor larger than the bucket gets a bucket of its own; order is preserved;
    bucket_bytes None or <= 0 yields everything as one bucket."""
    bucket: list[tuple[str, Any]] = []
    size = 0
    for name, t in named_tensors:
        n = tensor_nbytes(t)
        if bucket and bucket_bytes and bucket_bytes > 0 and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    if bucket:
        yield bucket


def bucket_bytes_from_mb(mb: float | int | None) -> int | None:
    return None if not mb or mb <= 0 else int(mb * (1 << 20))


# --------------------------------------------------------------------------- SGLang wire format
def request_to_sglang(req: GenerateRequest, *, return_prompt_token_ids: bool = True) -> dict[str, Any]:
    """The body of SGLang's `POST /generate` for one request (single, not batch, form)."""
    body: dict[str, Any] = {"sampling_params": req.sampling.to_sglang(), "return_logprob": bool(req.return_logprob)}
    if req.text is not None:
        body["text"] = req.text
    else:
        body["input_ids"] = list(req.input_ids or ())
    if req.images:
        body["image_data"] = list(req.images) if len(req.images) > 1 else req.images[0]
    if req.rid is not None:
        body["rid"] = req.rid
    if return_prompt_token_ids:
        body["return_prompt_token_ids"] = True
    if req.return_routed_experts:
        body["return_routed_experts"] = True
    return body


def encode_routed_experts(values: Iterable[int]) -> str:
    """The wire form of routed experts: base64 of little-endian int32 (SGLang's)."""
    import array
    import base64
    import sys

    arr = array.array("i", values)
    if sys.byteorder != "little":  # pragma: no cover
        arr.byteswap()
    return base64.b64encode(arr.tobytes()).decode("ascii")


def routed_experts_bytes(data: str, *, tokens: int, layers: int, topk: int) -> bytes:
    """The little-endian int32 bytes of `data` (`encode_routed_experts`), checked to hold
    [tokens - 1, layers, topk]; raises ValueError naming what is off."""
    import base64
    import binascii

    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError, TypeError) as e:
        raise ValueError(f"routed_experts is not base64: {e}") from None
    if len(raw) % 4:
        raise ValueError(f"routed_experts holds {len(raw)} bytes, not a whole number of int32")
    want = max(tokens - 1, 0) * layers * topk
    if len(raw) // 4 != want:
        raise ValueError(f"routed_experts holds {len(raw) // 4} ids; {tokens} tokens x {layers} layers x top-{topk} "
                         f"need {want} ([tokens - 1, layers, top-k])")
    return raw


def decode_routed_experts(data: str, *, tokens: int, layers: int, topk: int) -> list[int]:
    """The flat int32 values of `data` (`encode_routed_experts`), checked to hold
    [tokens - 1, layers, topk]; raises ValueError naming what is off."""
    import array
    import sys

    arr = array.array("i")
    arr.frombytes(routed_experts_bytes(data, tokens=tokens, layers=layers, topk=topk))
    if sys.byteorder != "little":  # pragma: no cover
        arr.byteswap()
    return arr.tolist()


def _finish(meta: dict[str, Any]) -> tuple[str, int | str | None]:
    fr = meta.get("finish_reason")
    if fr is None:
        return FINISH_ABORT, None
    if isinstance(fr, str):  # some servers flatten it
        return fr, None
    kind = fr.get("type", FINISH_ABORT)
    return kind, fr.get("matched")


def result_from_sglang(d: dict[str, Any], *, rid: str | None = None) -> GenerateResult:
    """Parse one element of SGLang's `/generate` reply.

    Raises EngineError for an aborted request (SGLang answers 200 with finish_reason
    {"type": "abort", "message": ...} for some failures)."""
    meta = d.get("meta_info") or {}
    kind, matched = _finish(meta)
    if kind == FINISH_ABORT:
        fr = meta.get("finish_reason") or {}
        msg = fr.get("message", "aborted") if isinstance(fr, dict) else str(fr)
        raise EngineError(f"request aborted by the engine: {msg}", retryable=True)
    lp_entries = meta.get("output_token_logprobs")
    output_ids = d.get("output_ids")
    if output_ids is None and lp_entries is not None:
        output_ids = [int(e[1]) for e in lp_entries]
    output_ids = [int(t) for t in (output_ids or [])]
    logprobs = None
    if lp_entries is not None:
        logprobs = [float(e[0]) for e in lp_entries]
        ids_from_lp = [int(e[1]) for e in lp_entries]
        if ids_from_lp != output_ids:
            raise EngineError(
                f"output_ids and output_token_logprobs disagree ({len(output_ids)} vs {len(ids_from_lp)} tokens)",
                retryable=False,
            )
    prompt_ids = d.get("prompt_token_ids")
    return GenerateResult(
        output_ids=output_ids,
        text=d.get("text") or "",
        logprobs=logprobs,
        finish_reason=kind,
        prompt_tokens=int(meta.get("prompt_tokens", len(prompt_ids) if prompt_ids else 0)),
        matched_stop=matched,
        prompt_ids=None if prompt_ids is None else [int(t) for t in prompt_ids],
        rid=meta.get("id", rid),
        weight_version=meta.get("weight_version"),
        routed_experts=meta.get("routed_experts"),
    )


def result_to_sglang(res: GenerateResult, *, return_logprob: bool, return_prompt_token_ids: bool) -> dict[str, Any]:
    """The embedded server's reply for one request, in SGLang's shape."""
    finish: dict[str, Any] = {"type": res.finish_reason}
    if res.finish_reason == FINISH_STOP:
        finish["matched"] = res.matched_stop
    elif res.finish_reason == FINISH_LENGTH:
        finish["length"] = len(res.output_ids)
    meta: dict[str, Any] = {
        "id": res.rid,
        "finish_reason": finish,
        "prompt_tokens": res.prompt_tokens,
        "completion_tokens": len(res.output_ids),
        "cached_tokens": 0,
        "weight_version": res.weight_version,
    }
    if return_logprob:
        lps = res.logprobs or []
        meta["output_token_logprobs"] = [[float(lp), int(t), None] for lp, t in zip(lps, res.output_ids)]
    if res.routed_experts is not None:
        meta["routed_experts"] = res.routed_experts
    out: dict[str, Any] = {"text": res.text, "output_ids": list(res.output_ids), "meta_info": meta}
    if return_prompt_token_ids and res.prompt_ids is not None:
        out["prompt_token_ids"] = list(res.prompt_ids)
    return out


def requests_from_sglang(body: dict[str, Any]) -> tuple[list[GenerateRequest], bool, bool]:
    """Parse a `/generate` body (single or batch form).

    Returns (requests, is_batch, return_prompt_token_ids). Batch form: `text` is a list of
    strings or `input_ids` a list of lists; `image_data`, `sampling_params`,
    `return_logprob` and `rid` are then lists with one entry per request (or one value
    shared by all). Images of one request: a string or a list of strings."""
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise EngineError("exactly one of 'text' or 'input_ids' is required", retryable=False, status=400)
    if text is not None:
        is_batch = isinstance(text, list)
        prompts = text if is_batch else [text]
        if not all(isinstance(t, str) for t in prompts):
            raise EngineError("'text' must be a string or a list of strings", retryable=False, status=400)
    else:
        is_batch = bool(ids) and isinstance(ids[0], list)
        prompts = ids if is_batch else [ids]
    n = len(prompts)
    images = body.get("image_data")
    if images is None:
        per_images: list[Any] = [None] * n
    elif is_batch:
        if not isinstance(images, list) or len(images) != n:
            raise EngineError("batch form: 'image_data' needs one entry per request", retryable=False, status=400)
        per_images = images
    else:
        per_images = [images]
    sp = body.get("sampling_params")
    per_sp = sp if isinstance(sp, list) else [sp] * n
    if len(per_sp) != n:
        raise EngineError("batch form: 'sampling_params' needs one entry per request", retryable=False, status=400)
    lp = body.get("return_logprob", False)
    per_lp = lp if isinstance(lp, list) else [lp] * n
    experts = body.get("return_routed_experts", False)
    per_experts = experts if isinstance(experts, list) else [experts] * n
    if len(per_lp) != n or len(per_experts) != n:
        raise EngineError("batch form: 'return_logprob' / 'return_routed_experts' need one entry per request",
                          retryable=False, status=400)
    rid = body.get("rid")
    if isinstance(rid, list):
        per_rid = rid
    elif n == 1 or rid is None:
        per_rid = [rid] * n
    else:
        per_rid = [f"{rid}-{i}" for i in range(n)]
    reqs = []
    for i in range(n):
        imgs = per_images[i]
        if imgs is None:
            imgs = ()
        elif isinstance(imgs, str):
            imgs = (imgs,)
        elif isinstance(imgs, dict):  # {"url": ...} style
            imgs = (imgs.get("url") or imgs.get("data"),)
        else:
            imgs = tuple(x.get("url") if isinstance(x, dict) else x for x in imgs)
        try:
            reqs.append(GenerateRequest(
                text=prompts[i] if text is not None else None,
                input_ids=tuple(int(t) for t in prompts[i]) if ids is not None else None,
                images=tuple(imgs),
                sampling=SamplingParams.from_sglang(per_sp[i]),
                return_logprob=bool(per_lp[i]),
                rid=per_rid[i],
                return_routed_experts=bool(per_experts[i]),
            ))
        except (TypeError, ValueError) as e:
            raise EngineError(f"bad request {i}: {e}", retryable=False, status=400) from e
    return reqs, is_batch, bool(body.get("return_prompt_token_ids", False))
