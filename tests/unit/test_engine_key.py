"""The run's engine key: drawn once per run, readable by its owner only, checked as SGLang
checks `--api-key` (constant time, /health and /metrics open), never in a logged command line."""

from __future__ import annotations

import stat

import pytest


def test_run_key_is_drawn_once_and_owner_readable(tmp_path):
    from vlmrl.rollout.auth import KEY_FILE, read_key, run_key

    key = run_key(tmp_path)
    assert len(key) >= 40 and run_key(tmp_path) == key  # a resume reads the same key
    path = tmp_path / KEY_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert run_key(tmp_path / "other") != key
    path.chmod(0o644)
    with pytest.raises(ValueError, match="readable by others"):
        read_key(path)


def test_authorization_follows_sglangs_rules():
    from vlmrl.rollout.auth import authorized, bearer, redact

    key = "k" * 43
    assert authorized("/generate", None, None)  # no key: open
    assert authorized("/health", None, key) and authorized("/health_generate", None, key)
    assert authorized("/metrics", None, key)
    assert not authorized("/generate", None, key)
    assert not authorized("/update_weights_from_tensor", "Bearer wrong", key)
    assert not authorized("/generate", f"Basic {key}", key)
    assert authorized("/release_memory_occupation", bearer(key)["Authorization"], key)
    assert authorized("/generate", f"bearer {key}", key)
    cmd = ["python", "-m", "sglang.launch_server", "--api-key", key, "--port", "1", "--admin-api-key", key]
    shown = " ".join(redact(cmd))
    assert key not in shown and shown.count("***") == 2 and "--port 1" in shown
