"""vlmrl's general plugin for SGLang (the `sglang.srt.plugins` entry point of the
`vlmrl_sglang_hooks-1.0.dist-info` beside this file): SGLang loads it in every server process,
the schedulers included, and applies the hooks it registers before serving.

The one hook: the GPU finishes its queued work before torch_memory_saver unmaps a region.
`release_memory_occupation` in SGLang 0.5.17 pauses (unmaps) the KV cache, the weights and the
CUDA-graph pool first and synchronizes the device after them. A scheduler that is idle on the
host may still have its last decode step or CUDA-graph replay running on the GPU, and the
release itself queues copies of the model's buffers just before it unmaps the weights. When such
work reads a region after its pages are gone, the next synchronize reports "an illegal memory
access". vlmrl hit this in 12 of 18 colocated runs that shared one H100 (the more runs on the
GPU, the later the queued work ends; bench/results/learning-precision/). Synchronizing before
every pause closes both windows; it costs one device synchronize per released tag.
`VLMRL_SGLANG_SYNC_BEFORE_PAUSE=0` in the server's environment (`+rollout.sglang.env....`)
leaves the hook out, to measure SGLang without it.

Imports torch alone (and SGLang's hook registry when SGLang loads it): this folder sits on the
server's PYTHONPATH by itself, and the server's environment need not have vlmrl's dependencies.
"""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger(__name__)

# the method that unmaps a tagged region (sglang/srt/utils/torch_memory_saver_adapter.py)
PAUSE_TARGET = "sglang.srt.utils.torch_memory_saver_adapter._TorchMemorySaverAdapterReal.pause"
SWITCH_ENV = "VLMRL_SGLANG_SYNC_BEFORE_PAUSE"


def synchronize_before_pause(*args: Any, **kwargs: Any) -> None:
    """SGLang BEFORE hook on `PAUSE_TARGET`: wait for every stream of this device."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def register() -> None:
    """Called by SGLang's `load_plugins()` in each server process."""
    import pkgutil

    if os.environ.get(SWITCH_ENV, "1") == "0":
        log.warning("vlmrl: %s=0, memory releases unmap regions without synchronizing first", SWITCH_ENV)
        return

    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    owner, _, method = PAUSE_TARGET.rpartition(".")
    try:
        cls = pkgutil.resolve_name(owner)
        getattr(cls, method)
    except (ImportError, AttributeError) as e:  # a release that moved it: say so, serve on
        log.warning("vlmrl: %s not found (%s); a memory release may unmap regions the GPU still reads",
                    PAUSE_TARGET, e)
        return
    HookRegistry.register(PAUSE_TARGET, synchronize_before_pause, HookType.BEFORE)
