"""Code that runs inside SGLang's server processes, put on their PYTHONPATH as a folder of
its own (`PLUGIN_DIR`): its modules import torch alone, never vlmrl, whose dependencies the
server's environment may not have.

- `vlmrl_sglang_loader.load_weights`: the weight loader the colocated sync names
  (`--custom-weight-loader`, `rollout.sglang.weight_loader=vlmrl`).
- `vlmrl_sglang_hooks.register`: a general plugin of SGLang's (entry point group
  `sglang.srt.plugins`, declared by the `vlmrl_sglang_hooks-1.0.dist-info` folder here, which
  SGLang finds on the PYTHONPATH): the device synchronizes before a memory release unmaps a
  region.
"""

from __future__ import annotations

from pathlib import Path

PLUGIN_DIR = str(Path(__file__).resolve().parent)
# the dotted path SGLang imports (`--custom-weight-loader`) and the sync sends as load_format
LOADER = "vlmrl_sglang_loader.load_weights"
# the plugin's entry-point name (SGLANG_PLUGINS, where a user sets that allow-list, must name it)
HOOKS = "vlmrl_sglang_hooks"
