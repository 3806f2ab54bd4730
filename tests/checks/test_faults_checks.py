"""The fault suite's invariant checks (scripts/faults/checks.py) on hand-made records: each
bound holds where the arithmetic of its definition says it does, and fails just past it.
The figures are worked by hand from the bounds in scripts/faults/__init__.py (L = 60
requests per 20 s, so r = 3/s; C = 4 slots; ceil(L/2) = 30 locally per Envoy process)."""

from faults import checks
from faults.settings import CONC_LIMIT, REQ_LIMIT, WINDOW_S


def rec(ts, *, inst="A1", status=200, degraded=None, te=None, th=None, body=None, reserved=None):
    """One request as traffic.py records it."""
    return {"tenant": "t", "inst": inst, "status": status, "degraded": degraded, "ts": ts,
            "th": ts if th is None else th, "te": ts + 0.01 if te is None else te, "body": body, "err": None,
            "asked": None, "reserved": reserved, "ptok": None, "ctok": None}


def verdicts(label, recs, events=()):
    return {c["name"]: c["ok"] for c in checks.check_tenant(label, recs, list(events))}


def test_the_settings_are_the_ones_the_figures_below_were_worked_for():
    assert (REQ_LIMIT, WINDOW_S, CONC_LIMIT) == (60, 20.0, 4)


def test_pair_check_bounds_any_run_by_capacity_plus_refill():
    # 10 within 0.1 s against capacity 10 and 1/s: at most 10 + 0.1.
    assert checks.pair_check([(i / 100, i / 100, 1) for i in range(10)], 10, 1.0)["excess"] <= 0
    # 12 within 1 s: 12 > 10 + 1, by exactly 1.
    worst = checks.pair_check([(i / 11, i / 11, 1) for i in range(12)], 10, 1.0)
    assert abs(worst["excess"] - 1.0) < 1e-9 and worst["sum"] == 12 and worst["n"] == 12
    # Pending credits at the run's start widen the bound.
    assert checks.pair_check([(0.0, 0.0, 12)], 10, 1.0, pending=lambda a: 2)["excess"] <= 0


def test_max_overlap_counts_what_is_in_flight_at_once():
    assert checks.max_overlap([(0, 2), (1, 3), (2, 4)]) == (2, 1)  # an end frees its slot for a start then
    assert checks.max_overlap([(0, 2), (1, 3), (1.5, 4)]) == (3, 1.5)
    assert checks.max_overlap([(1, 1), (2, 1)]) == (0, None)  # empty intervals hold nothing


def test_settlement_deadline_waits_out_the_outage_that_held_it():
    assert checks.settle_deadline({"te": 5.0}, []) == 6.0
    assert checks.settle_deadline({"te": 5.0}, [(4.0, 8.0)]) == 10.0
    assert checks.settle_deadline({"te": 5.0}, [(7.0, 9.0)]) == 6.0  # began after the deadline


def test_classify_tells_the_filters_5xx_from_the_mocks_and_the_killed_envoys():
    events = [{"inst": "B1", "start": 10.0, "kill": True, "what": "envoy B SIGKILL"}]
    recs = [
        rec(1.0),
        rec(1.0, status=429, degraded="1"),
        rec(1.0, status=503, body='{"error": {"type": "rate_limiter_unavailable"}}'),
        rec(1.0, status=500, body="The mock was asked to fail"),
        rec(1.0, status=502, body="upstream connect error"),
        rec(9.8, inst="B1", status=502, te=9.9, body="upstream connect error"),
        {**rec(1.0, status=None), "err": "ConnectionRefusedError"},
    ]
    recs[3]["asked"] = "500"
    checks.classify(recs, events)
    assert [r["cls"] for r in recs] == [
        "200", "429 degraded", "503 filter rate_limiter_unavailable", "500 from the mock (asked)",
        "502 Envoy/filter", "502 Envoy (Envoy being killed)", "conn error (live Envoy)"]
    assert checks.admitted(recs[3]) and not checks.admitted(recs[4])


def test_central_requests_bound_holds_at_the_limit_and_fails_past_it():
    # 60 in 0.5 s: bound 60 + 3 x 0.5 = 61.5.
    assert verdicts("heavy-req-1", [rec(i / 120) for i in range(60)])["central requests"]
    # 63 in 0.5 s: 63 > 61.5.
    assert not verdicts("heavy-req-1", [rec(i / 124) for i in range(63)])["central requests"]
    # Refused requests are not admissions.
    assert verdicts("heavy-req-1", [rec(i / 124, status=429 if i >= 60 else 200) for i in range(63)])[
        "central requests"]


def test_a_redis_restart_starts_the_central_bound_again():
    burst = [rec(10 + i / 200) for i in range(60)] + [rec(10.5 + i / 200) for i in range(60)]
    assert not verdicts("heavy-req-1", burst)["central requests"]
    restart = [{"what": "redis SIGKILL and restart", "start": 10.45, "end": 10.5}]
    assert verdicts("heavy-req-1", burst, restart)["central requests"]


def test_local_admissions_are_bounded_per_envoy_process():
    # ceil(60/2) = 30 per process, refilling 1.5/s: 31 in 0.3 s from one process fails,
    # the same 31 split across two processes passes.
    one = [rec(i / 100, degraded="1") for i in range(31)]
    assert not verdicts("heavy-req-1", one)["local requests A1"]
    two = [rec(i / 100, degraded="1", inst="AB"[i % 2] + "1") for i in range(31)]
    assert all(ok for name, ok in verdicts("heavy-req-1", two).items() if name.startswith("local requests"))


def test_central_concurrency_counts_streams_in_flight_less_the_read_margin():
    # Four 2 s streams at once: at C.
    streams = [rec(0.1 * i, th=0.1 * i, te=2.0 + 0.1 * i) for i in range(4)]
    assert verdicts("heavy-conc", streams)["central concurrency"]
    # A fifth overlapping them all: past C.
    assert not verdicts("heavy-conc", streams + [rec(0.5, th=0.5, te=2.5)])["central concurrency"]
    # A fifth whose headers came 10 ms before the first stream's last byte: within the
    # client's read latency, so not an overlap.
    assert verdicts("heavy-conc", streams + [rec(1.99, th=1.99, te=4.0)])["central concurrency"]
    # Concurrency is checked only for the slow-stream tenant.
    assert "central concurrency" not in verdicts("heavy-req-1", streams)
