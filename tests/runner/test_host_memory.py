"""The allocator thresholds a CPU runner sets (loom/runner/host_memory.py)."""

from __future__ import annotations

import ctypes.util
import platform
import subprocess
import sys

import pytest

# Minor page faults of five rounds of allocating and filling a 40 MB buffer, in a fresh
# process, with or without the thresholds raised first.
_PROBE = """
import resource, sys, torch
from loom.runner.host_memory import keep_freed_memory
if sys.argv[1] == "raised":
    assert keep_freed_memory()
torch.empty(10 * 2**20).fill_(1.0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    torch.empty(10 * 2**20).fill_(1.0)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True,
                         check=True).stdout
    return int(out.strip().splitlines()[-1])


@pytest.mark.skipif(platform.system() != "Linux" or ctypes.util.find_library("c") is None,
                    reason="glibc's mallopt only")
def test_large_step_buffers_are_reused_without_page_faults() -> None:
    """glibc maps a fresh 40 MB buffer each time (10,240 pages faulted in and zeroed per
    round: about 51,000 in five); with the thresholds raised the heap grows once and the
    freed buffer is reused (about 10,000)."""
    assert _faults("default") > 4 * 10_240
    assert _faults("raised") < 1.5 * 10_240
