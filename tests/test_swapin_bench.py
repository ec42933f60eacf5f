"""``kvbench swapin`` runs end to end on a small CPU workload, checks every byte it moved and reports ratios to
the contiguous copy; a bad option is one line and exit status 2. (No timing is asserted: benchmarks are not tests.)"""

from __future__ import annotations

import json
import subprocess
import sys

KVBENCH = [sys.executable, "-m", "kvtier.tools.kvbench", "swapin"]


def test_swapin_bench_reports_cpu_ratios() -> None:
    args = ["--page-sizes", "16KiB", "--cpu-bytes", "1MiB", "--rounds", "1", "--no-gpu", "--json"]
    done = subprocess.run([*KVBENCH, *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    cpu = result["cpu"]["16384"]
    assert cpu["blocks"] == 64
    assert set(cpu["gbps"]) == {"memcpy", "torch_copy", "swap_in", "swap_out", "index_copy"}
    assert cpu["swap_in_vs_copy"] > 0 and cpu["swap_out_vs_copy"] > 0
    assert "gpu" not in result


def test_swapin_bench_refuses_a_page_size_that_is_not_whole_pages() -> None:
    done = subprocess.run([*KVBENCH, "--page-sizes", "5000"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    message = "kvbench: error: --rounds must be positive and page sizes multiples of 4KiB"
    assert done.stderr.strip().splitlines() == [message]
