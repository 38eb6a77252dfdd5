"""What every SGLang server vlmrl starts is given beside its flags: the environment beneath
`rollout.sglang.env`, and the ServerArgs fields that carry the run's engine key."""

from __future__ import annotations

# What every SGLang server vlmrl starts runs with, beneath `rollout.sglang.env`. SGLang keeps the
# vision tower's output per image (100 MB by default) and no weight update or cache flush clears
# it: after a sync that changed the vision tower, an image seen before would reach the language
# model with the old tower's features (seen on the H200: the engine-trainer logprob gap grew
# from 0.01 to 0.06 after three steps). SGLang's own RL mode (`rl_on_policy_target`) turns it off
# the same way.
VLM_CACHE_ENV = "SGLANG_VLM_CACHE_SIZE_MB"
SERVER_ENV = {VLM_CACHE_ENV: "0"}

# the ServerArgs fields that carry the engine key (SGLang's flags --api-key, --admin-api-key)
SGLANG_KEY_ARGS = ("api_key", "admin_api_key")
