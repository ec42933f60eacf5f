"""``kvbench route`` (the routing simulation) on hand-computed cases and a generated trace, and ``kvbench fit-cost``
on the tiny checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.serving.cost import CostModel
from kvtier.tools.route_sim import cached_tokens, simulate
from kvtier.tools.traces import Request, chat_trace, write_trace

FLAT = CostModel(a=0.0, b=0.001, g=0.0, decode_a=0.01)  # 1 ms a prompt token, 10 ms a decode step


def kvbench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvtier.tools.kvbench", *args], capture_output=True, text=True,
                          timeout=600, check=False)  # fmt: skip


def test_one_request_prefills_in_budgeted_chunks_then_decodes_a_token_a_step() -> None:
    trace = [Request(0, 1000, 3, [1, 2])]
    r = simulate(trace, 1, 1, "deepinfer", FLAT, block_tokens=512, step_budget_s=0.2)
    # 0.2 s fits no 512-token chunk: steps of 512 (forced) and 488 tokens, 1.0 s; then 2 decode steps of 10 ms
    assert r["ttft_s"]["p50"] == pytest.approx(1.0)
    assert r["tbt_s"]["p50"] == pytest.approx(0.01)
    assert r["slo_attainment"] == 1.0


def test_a_repeated_prefix_is_cached_and_costs_nothing_to_prefill() -> None:
    trace = [Request(0, 1024, 1, [7, 8]), Request(5000, 1024, 1, [7, 8])]
    assert cached_tokens(trace, 512, None) == [0, 1023]  # all but the last token, which is always computed
    r = simulate(trace, 1, 1, "round-robin", FLAT, block_tokens=512)
    assert r["ttft_s"]["p50"] == pytest.approx((1.024 + 0.001) / 2)


def test_balance_is_measured_against_a_longest_first_schedule() -> None:
    # four requests in one window on two engines: round-robin puts 3 s + 1 s on engine 0 and 2 s + 2 s on 1
    trace = [Request(t, n, 1, [t]) for t, n in ((0, 3000), (1, 2000), (2, 1000), (3, 2000))]
    r = simulate(trace, 2, 1, "round-robin", FLAT, block_tokens=512, step_budget_s=10.0, window_s=100.0)
    assert r["prefill_balance"]["vs_lpt"] == pytest.approx(4.0 / 4.0)  # LPT: {3, 1}, {2, 2}: makespan 4 s
    rr = simulate(trace[:3], 2, 1, "round-robin", FLAT, block_tokens=512, step_budget_s=10.0, window_s=100.0)
    assert rr["prefill_balance"]["vs_lpt"] == pytest.approx(3.0 / 4.0)  # RR {3, 1} vs LPT {3}, {2, 1}


def test_kvbench_route_compares_the_policies_on_a_generated_trace(tmp_path: Path) -> None:
    write_trace(tmp_path / "chat.jsonl", chat_trace(300, seed=2, rate_per_s=8))
    done = kvbench("route", str(tmp_path / "chat.jsonl"), "--prefill", "2", "--decode", "2", "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert set(out["policies"]) == {"deepinfer", "round-robin", "least-loaded"}
    for r in out["policies"].values():
        assert r["requests"] == 300 and 0 < r["prefill_balance"]["vs_lpt"] <= 1.05
        assert r["ttft_s"]["p50"] <= r["ttft_s"]["p99"] and 0 <= r["slo_attainment"] <= 1


def test_kvbench_route_refuses_a_bad_trace_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "bad.jsonl").write_text('{"timestamp": 0}\n')
    done = kvbench("route", str(tmp_path / "bad.jsonl"), "--prefill", "1", "--decode", "1")
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "input_length" in done.stderr
    done = kvbench("route", str(tmp_path / "bad.jsonl"), "--prefill", "0", "--decode", "1")
    assert done.returncode == 2 and "at least 1" in done.stderr


@pytest.mark.usefixtures("one_torch_thread")
def test_kvbench_fit_cost_measures_steps_and_writes_a_model_the_server_reads(tmp_path: Path) -> None:
    out = tmp_path / "cost.json"
    done = kvbench("fit-cost", "--chunks", "512,1024", "--cached", "0,512", "--decode-kv", "256",
                   "--decode-requests", "1,2", "--repeats", "1", "--out", str(out), "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    model = CostModel.load(out)
    assert len(result["prefill_steps"]) == 4 and model.rel_error == result["model"]["rel_error"] >= 0
    assert model.prefill_s(1024, 0) > model.prefill_s(512, 0) > 0
