"""Rollout engines: one async protocol, the embedded HF engine, SGLang, the manager.

    protocol   GenerateRequest / SamplingParams / GenerateResult, the `Engine` protocol and
               the logprob contract; SGLang's /generate wire format
    embedded   EmbeddedEngine (HF transformers, own KV-cache decode loop), Ray actor wrapper
    server     aiohttp server speaking SGLang's native HTTP subset (fronts any Engine)
    serve      `python -m vlmrl.rollout.serve --model DIR --port N`
    client     HTTPEngine: the one async HTTP client (SGLang servers and the embedded one)
    sglang     SGLang launch command / Ray actors / router, trainer-side weight sync
    manager    RolloutManager: groups of n samples, bounded in-flight, retries, dropped groups

Importing this package does not import torch, ray, aiohttp or transformers.
"""

from __future__ import annotations

from typing import Any

from .protocol import (
    FINISH_LENGTH,
    FINISH_STOP,
    Engine,
    EngineError,
    GenerateRequest,
    GenerateResult,
    SamplingParams,
    bucket_bytes_from_mb,
    bucketize,
)

_LAZY = {
    "EmbeddedEngine": "embedded",
    "RayEngine": "embedded",
    "create_embedded_actor": "embedded",
    "HTTPEngine": "client",
    "SGLangClient": "client",
    "ThreadedServer": "server",
    "start_server": "server",
    "RolloutManager": "manager",
    "RolloutPrompt": "manager",
    "SampleRecord": "manager",
    "RolloutStats": "manager",
    "RolloutBatch": "manager",
    "launch_sglang_engines": "sglang",
    "server_args": "sglang",
    "server_command": "sglang",
}

__all__ = [
    "FINISH_LENGTH",
    "FINISH_STOP",
    "Engine",
    "EngineError",
    "GenerateRequest",
    "GenerateResult",
    "SamplingParams",
    "bucket_bytes_from_mb",
    "bucketize",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'vlmrl.rollout' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f".{module}", __name__), name)
