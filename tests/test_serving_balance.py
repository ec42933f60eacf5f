"""The balancers and the cost model on small cases computed by hand (no model, no processes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.serving import cli as serving_cli
from kvtier.serving.cost import MAX_CHUNK_TOKENS, CostModel, fit
from kvtier.serving.decode_balance import added_step_s, pick_decode, ratios
from kvtier.serving.prefill_balance import PrefillBalancer, assign_engines, bucket_of, nearest_served
from kvtier.tools.route_sim import H200_8B


@pytest.mark.parametrize(
    ("tokens", "bucket"), [(1, 0), (16_383, 0), (16_384, 1), (65_535, 1), (65_536, 2), (262_143, 2), (262_144, 3)]
)
def test_requests_fall_in_four_buckets_by_context_length(tokens: int, bucket: int) -> None:
    assert bucket_of(tokens) == bucket


def test_bucket_edges_are_configurable() -> None:
    assert [bucket_of(n, (1000, 2000)) for n in (999, 1000, 5000)] == [0, 1, 2]


def test_engines_go_to_buckets_in_proportion_to_demand() -> None:
    assert assign_engines([6, 3, 3, 0], 4) == [{0: 1, 1: 1}, {2: 1}, {3: 1}, {3: 1}]
    # shares 0.5, 2.5, 1, 0: engine 0 is half the short bucket's, half the 16–64K bucket's
    assert assign_engines([1, 5, 2, 0], 4) == [{0: 0.5}, {0: 0.5, 1: 1, 2: 1}, {3: 1}, {3: 1}]
    assert assign_engines([0, 0, 0, 0], 2) == [{0: 1, 1: 1}] * 4  # no demand yet: every engine serves all


def test_a_bucket_without_demand_borrows_the_nearest_buckets_engines() -> None:
    served = [{0: 1.0}, {}, {1: 1.0}, {}]
    assert [nearest_served(b, served) for b in range(4)] == [0, 2, 2, 2]  # a tie goes to the longer bucket


def test_the_prefill_balancer_reassigns_engines_from_the_last_windows_demand() -> None:
    b = PrefillBalancer(engines=4, window_s=10.0)
    assert b.served == [dict.fromkeys(range(4), 1.0)] * 4
    for tokens, cost, now in ((1_000, 6.0, 0.0), (20_000, 3.0, 1.0), (70_000, 3.0, 2.0)):
        b.done(b.route(tokens, cost, now), cost)
    assert b.route(1_000, 1.0, now=10.5) in (0, 1)  # the next window: demand [6, 3, 3, 0] → [2, 1, 1, 0]
    assert b.served == [{0: 1, 1: 1}, {2: 1}, {3: 1}, {3: 1}]
    assert b.route(300_000, 0.1, now=11.0) == 3  # ≥ 256K had no demand: the 64–256K bucket's engine


def test_a_window_with_nothing_after_it_lets_every_engine_serve_every_bucket() -> None:
    b = PrefillBalancer(engines=2, window_s=10.0)
    b.route(1_000, 5.0, now=0.0)
    b.route(1_000, 5.0, now=25.0)  # two windows later: the demand counted is stale
    assert b.served == [{0: 1, 1: 1}] * 4


def test_a_short_request_goes_where_the_least_work_is_ahead_of_it() -> None:
    """Engines compute the least prompt left first: a 0.1 s request waits for the shorter work only."""
    b = PrefillBalancer(engines=2, window_s=1e9, edges=(10**9,), spill_s=1e9)
    assert [b.route(100, c, now=0.0) for c in (10.0, 0.1, 0.1, 0.1)] == [0, 1, 1, 1]
    assert b.queued == [[10.0], [0.1, 0.1, 0.1]]
    # ahead of a new 0.1 s request: engine 0 min(10, 0.1) = 0.1 + 10 given this window, engine 1 0.3 + 0.3
    assert b.route(100, 0.1, now=0.0) == 1
    b.assigned = [0.0, 0.0]  # a new window: only the work ahead counts
    assert b.route(100, 0.1, now=0.0) == 0
    b.done(0, 10.0)
    assert b.queued[0] == [0.1]


def test_a_backed_up_bucket_spills_to_the_least_loaded_engine() -> None:
    b = PrefillBalancer(engines=2, window_s=1e9, spill_s=1.0)
    b.served = [{0: 1.0}, {1: 1.0}, {1: 1.0}, {1: 1.0}]
    assert b.route(1_000, 0.9, now=0.0) == 0
    assert b.route(1_000, 0.9, now=0.0) == 0  # 0.9 s ahead on engine 0: within the spill margin
    assert b.route(1_000, 0.9, now=0.0) == 1  # 1.8 s ahead: spills to the idle engine of the other bucket


H200 = H200_8B  # the simulation's default model


def test_decode_ratios_compare_both_loads_with_the_mean_after_placement() -> None:
    # A: 2 requests, 60K cached; B: 6 requests, 20K; a 1K request: n̄ = 4.5, kv̄ = 40.5K
    assert ratios([2, 6], [60_000, 20_000], 1_000) == pytest.approx([61 / 40.5, 7 / 4.5])


def test_decode_sends_a_request_where_it_slows_the_fewest_tokens() -> None:
    # both replicas are within 25 % on ratios; A adds 2·(b + g·L) + d(3, 61K), B 6·(b + g·L) + d(7, 21K)
    assert added_step_s(2, 60_000, 1_000, H200) == pytest.approx(2 * 2.07e-4 + 0.008 + 3 * 2e-4 + 61_000 * 7e-9)
    assert pick_decode([2, 6], [60_000, 20_000], 1_000, H200) == 0  # short: few requests, long caches
    assert pick_decode([2, 6], [60_000, 20_000], 40_000, H200) == 0  # long: its KV slows 2 requests, not 6


def test_decode_keeps_kv_from_piling_up_past_the_mean() -> None:
    # A holds 300K: a 60K request would put A at 1.89× the mean KV, B is at 1.43× in requests → A is out
    assert ratios([2, 4], [300_000, 20_000], 60_000) == pytest.approx([360 / 190, 5 / 3.5])
    assert pick_decode([2, 4], [300_000, 20_000], 60_000, H200) == 1


def test_decode_without_a_cost_model_takes_the_best_ratio_and_ties_go_to_the_lower_id() -> None:
    assert pick_decode([2, 6], [60_000, 20_000], 1_000) == 0
    assert pick_decode([2, 6], [60_000, 20_000], 40_000) == 1
    assert pick_decode([0, 0, 0], [0, 0, 0], 10, H200) == 0


def test_the_cost_model_is_quadratic_in_the_attention_term() -> None:
    m = CostModel(a=0.01, b=1e-5, g=1e-9)
    assert m.prefill_s(0, 100) == 0.0
    assert m.prefill_s(1000, 0) == pytest.approx(0.01 + 0.01 + 1e-9 * 1000 * 500.5)
    assert m.prefill_s(1000, 4000) == pytest.approx(0.01 + 0.01 + 1e-9 * 1000 * 4500.5)


def test_the_largest_chunk_fits_the_time_left() -> None:
    m = CostModel(a=0.01, b=1e-5, g=1e-9)
    q = m.largest_chunk(100_000, 0, 0.2)
    assert m.prefill_s(q, 0) <= 0.2 < m.prefill_s(q + 1, 0)
    granular = m.largest_chunk(100_000, 50_000, 0.2, granule=512)
    assert granular % 512 == 0 and m.prefill_s(granular, 50_000) <= 0.2 < m.prefill_s(granular + 512, 50_000)
    assert m.largest_chunk(300, 0, 10.0, granule=512) == 300  # all that is left fits
    assert m.largest_chunk(10**6, 0, 1e9) == MAX_CHUNK_TOKENS
    assert m.largest_chunk(1000, 0, 0.005) == 0  # not even the step's fixed cost fits


def test_fitting_recovers_the_coefficients_and_reports_its_error() -> None:
    truth = CostModel(a=0.002, b=3e-5, g=2e-9, decode_a=0.001, decode_b=2e-4, decode_g=1e-8)
    steps = [(q, c, truth.prefill_s(q, c)) for q in (512, 1024, 2048, 4096) for c in (0, 2048, 8192)]
    decode = [(n, kv, truth.decode_s(n, kv)) for n in (1, 2, 4) for kv in (1000, 5000)]
    got = fit(steps, decode)
    assert (got.a, got.b, got.g) == pytest.approx((truth.a, truth.b, truth.g), rel=1e-6)
    assert (got.decode_a, got.decode_b, got.decode_g) == pytest.approx((0.001, 2e-4, 1e-8), rel=1e-6)
    assert got.rel_error < 1e-9
    noisy = fit([(q, c, t * (1.1 if i % 2 else 0.9)) for i, (q, c, t) in enumerate(steps)])
    assert 0.05 < noisy.rel_error < 0.15 and noisy.max_rel_error >= noisy.rel_error


def test_a_fit_never_has_negative_coefficients() -> None:
    got = fit([(512, 0, 0.01), (1024, 0, 0.0199), (2048, 0, 0.0401)])
    assert min(got.a, got.b, got.g) >= 0


def test_a_cost_model_file_round_trips_and_a_bad_one_is_one_line(tmp_path) -> None:
    m = CostModel(0.1, 0.2, 0.3, rel_error=0.04)
    m.save(tmp_path / "cost.json")
    assert CostModel.load(tmp_path / "cost.json") == m
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a cost model file"):
        CostModel.load(tmp_path / "bad.json")


def test_an_engine_that_is_down_is_left_out() -> None:
    b = PrefillBalancer(engines=3, window_s=1e9)
    b.served = [{0: 1.0}, {1: 1.0, 2: 1.0}, {2: 1.0}, {2: 1.0}]
    assert b.route(1_000, 0.1, now=0.0, up=[False, True, True]) == 1  # bucket 0's only engine is restarting
    assert b.route(20_000, 0.1, now=0.0, up=[True, False, True]) == 2


def test_decode_moves_a_request_that_would_push_its_replica_past_the_tbt_slo_to_one_it_does_not() -> None:
    # rules 1–2 pick A (B holds 2× the mean KV); on A the step becomes d(216, 1K) = 51.2 ms > 50 ms, on B
    # d(151, 901K) = 44.5 ms: B takes it, and A's 215 requests keep their 50 ms
    assert pick_decode([215, 150], [0, 900_000], 1_000, H200) == 0
    assert pick_decode([215, 150], [0, 900_000], 1_000, H200, tbt_slo_s=0.05) == 1


def test_decode_past_the_slo_everywhere_loads_the_replica_already_past_it_most() -> None:
    # A steps 52.0 ms, B 58.0 ms, both past 50 ms whatever happens: the request goes to B (58.2 ms after it,
    # within 1.25× the mean of 55.1 ms), so A is the one that may come back within the SLO first
    assert pick_decode([220, 250], [0, 0], 1_000, H200) == 0
    assert pick_decode([220, 250], [0, 0], 1_000, H200, tbt_slo_s=0.05) == 1


def test_decode_never_loads_a_replica_past_the_cap_over_the_mean_step() -> None:
    # B at 88.0 ms would step 88.2 ms, more than 1.25× the mean after placement (70.1 ms → 87.6 ms): A keeps it
    assert pick_decode([220, 400], [0, 0], 1_000, H200, tbt_slo_s=0.05) == 0


def test_serve_refuses_a_tbt_slo_without_a_cost_model_to_predict_steps_with(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["serve", "--checkpoint", str(tmp_path), "--store", str(tmp_path / "c.toml"), "--tbt-slo-ms", "50"]
    assert serving_cli.main(argv) == 2
    assert "--tbt-slo-ms must be a positive number of milliseconds, with --cost-model" in capsys.readouterr().err


def test_decode_within_the_slo_places_as_rules_one_and_two_do() -> None:
    assert pick_decode([2, 6], [60_000, 20_000], 1_000, H200, tbt_slo_s=0.05) == 0
    assert pick_decode([2, 6], [60_000, 20_000], 40_000, H200, tbt_slo_s=0.05) == 0
