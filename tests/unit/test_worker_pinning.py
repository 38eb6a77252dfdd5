"""The suite's own set-up: under pytest-xdist each worker keeps to its share of the cores
(tests/conftest.py), which every process it starts inherits."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.skipif(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) < 2, reason="runs under two or more workers")
def test_each_worker_and_its_children_keep_to_their_share_of_the_cores():
    count = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    mine = os.sched_getaffinity(0)
    assert 1 <= len(mine) <= -(-os.cpu_count() // count), (mine, os.cpu_count(), count)
    child = subprocess.run([sys.executable, "-c", "import os, torch; print(len(os.sched_getaffinity(0)), "
                            "torch.get_num_threads())"], capture_output=True, text=True, check=True)
    assert child.stdout.split() == [str(len(mine))] * 2  # a rank or an engine: one thread per core it has
