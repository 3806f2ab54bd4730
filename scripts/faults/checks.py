"""The bounds the filter promised, checked over the recorded requests and fault events
(see the package's doc for each bound)."""

from __future__ import annotations

import math
from collections import defaultdict

from .settings import CONC_LIMIT, HEAVY, INSTANCES, READ_LATENCY_MARGIN_S, REQ_LIMIT, TOK_LIMIT, WINDOW_S


def admitted(rec: dict) -> bool:
    """Went upstream: a 200, or the mock's own error (the filter admitted it)."""
    return rec["status"] == 200 or (rec["status"] is not None and rec["status"] >= 500 and is_mock_error(rec))


def is_mock_error(rec: dict) -> bool:
    return bool(rec["body"]) and "The mock was asked to fail" in rec["body"]


def classify(results: list[dict], events: list[dict]) -> None:
    # An Envoy process that was SIGKILLed: its replies cut short, or refused before the
    # clients knew, are expected (from 0.5 s before the kill on).
    killed = {e["inst"]: e["start"] for e in events if e.get("kill")}
    for rec in results:
        near_kill = rec["inst"] in killed and rec["te"] >= killed[rec["inst"]] - 0.5
        s = rec["status"]
        if rec["err"] and s is None:
            rec["cls"] = "conn error (Envoy being killed)" if near_kill else "conn error (live Envoy)"
        elif rec["err"]:
            rec["cls"] = "truncated stream (Envoy being killed)" if near_kill else "truncated stream (live Envoy)"
        elif s == 200:
            rec["cls"] = "200 degraded" if rec["degraded"] else "200"
        elif s == 429:
            rec["cls"] = "429 degraded" if rec["degraded"] else "429"
        elif s >= 500 and is_mock_error(rec):
            rec["cls"] = f"{s} from the mock (asked)" if rec["asked"] else f"{s} from the mock (NOT asked)"
        elif s >= 500 and rec["body"] and "rate_limiter_unavailable" in rec["body"]:
            rec["cls"] = f"{s} filter rate_limiter_unavailable"
        elif s >= 500:
            rec["cls"] = f"{s} Envoy (Envoy being killed)" if near_kill else f"{s} Envoy/filter"
        else:
            rec["cls"] = f"{s} unexpected"


def pair_check(events: list[tuple], capacity: float, rate: float, pending=None) -> dict:
    """events: (t_lo, t_hi, value) sorted by t_lo. The worst excess of sum(values) over
    capacity + rate·(max t_hi − min t_lo) + pending(min t_lo), over every run of events."""
    worst = {"excess": -math.inf, "sum": 0, "bound": capacity, "span": 0.0, "at": None, "n": 0}
    n = len(events)
    for i in range(n):
        lo = events[i][0]
        extra = pending(lo) if pending else 0.0
        total, hi = 0.0, -math.inf
        for j in range(i, n):
            total += events[j][2]
            hi = max(hi, events[j][1])
            bound = capacity + rate * (hi - lo) + extra
            if total - bound > worst["excess"]:
                worst = {"excess": total - bound, "sum": total, "bound": bound, "span": hi - lo, "at": lo,
                         "n": j - i + 1, "pending": extra}
    return worst


def max_overlap(intervals: list[tuple[float, float]]) -> tuple[int, float | None]:
    points = []
    for a, b in intervals:
        if b > a:
            points.append((a, 1))
            points.append((b, -1))
    points.sort(key=lambda p: (p[0], p[1]))  # ends before starts at the same instant
    cur = best = 0
    at = None
    for t, d in points:
        cur += d
        if cur > best:
            best, at = cur, t
    return best, at


def epochs_of(events: list[dict]) -> list[float]:
    """Start of each Redis lifetime (relative times): the run's start, then each kill."""
    return [-math.inf] + sorted(e["start"] for e in events if e["what"].startswith("redis SIGKILL"))


def epoch_index(t: float, starts: list[float]) -> int:
    return max(i for i, s in enumerate(starts) if t >= s)


def outage_windows(events: list[dict]) -> list[tuple[float, float]]:
    return [(e["start"], e["end"]) for e in events
            if e["what"].startswith(("redis", "companion"))]


def settle_deadline(rec: dict, outages: list[tuple[float, float]]) -> float:
    """Latest time this request's settlement credit may reach Redis: 1 s after its reply
    ended, or 2 s after the outage that held it up."""
    deadline = rec["te"] + 1.0
    for start, end in sorted(outages):
        if start <= deadline and end >= rec["te"]:
            deadline = max(deadline, end + 2.0)
    return deadline


def check_tenant(label: str, recs: list[dict], events: list[dict]) -> list[dict]:
    """The bound checks of one heavy tenant: a list of {name, ok, text}."""
    starts = epochs_of(events)
    outages = outage_windows(events)
    adm = sorted((r for r in recs if admitted(r)), key=lambda r: r["ts"])
    central = [r for r in adm if not r["degraded"]]
    local = [r for r in adm if r["degraded"]]
    checks = []
    r_req, r_tok = REQ_LIMIT / WINDOW_S, TOK_LIMIT / WINDOW_S
    loc_req, loc_tok, loc_conc = math.ceil(REQ_LIMIT / INSTANCES), math.ceil(TOK_LIMIT / INSTANCES), math.ceil(
        CONC_LIMIT / INSTANCES)

    def used(r):  # tokens really charged after settlement (what the mock reports)
        if r["ptok"] is not None and r["ctok"] is not None:
            return r["ptok"] + r["ctok"]
        return r["reserved"] or 0

    credits = [(r["ts"], settle_deadline(r, outages), max(0, (r["reserved"] or 0) - used(r))) for r in adm]

    def pending(a):
        return sum(c for ts, dl, c in credits if ts < a <= dl)

    under = [r for r in adm if r["reserved"] is not None and used(r) > r["reserved"]]
    # Central share, per Redis lifetime.
    for dim, cap, rate, value, pend in (("requests", REQ_LIMIT, r_req, lambda r: 1, None),
                                        ("tokens", TOK_LIMIT, r_tok, used, pending)):
        worst, per_epoch = None, []
        for e in range(len(starts)):
            evs = [(r["ts"], r["th"], value(r)) for r in central if epoch_index(r["ts"], starts) == e]
            if not evs:
                continue
            w = pair_check(evs, cap, rate, pend)
            per_epoch.append((e, len(evs), w))
            if worst is None or w["excess"] > worst["excess"]:
                worst = w
        if worst is None:
            continue
        ok = worst["excess"] <= 1e-6
        checks.append({"name": f"central {dim}", "ok": ok, "text": (
            f"admitted by Redis {sum(n for _, n, _ in per_epoch)} over {len(per_epoch)} Redis lifetime(s); "
            f"worst run: {worst['sum']:.0f} in {worst['span']:.1f}s at t={worst['at']:.1f}s "
            f"vs L + r·Δt{' + pending credits ' + format(worst.get('pending', 0), '.0f') if pend else ''} "
            f"= {worst['bound']:.0f} (excess {worst['excess']:+.0f})")})
    # Local share, per Envoy process.
    by_inst = defaultdict(list)
    for r in local:
        by_inst[r["inst"]].append(r)
    for inst, rs in sorted(by_inst.items()):
        for dim, cap, value in (("requests", loc_req, lambda r: 1), ("tokens", loc_tok, lambda r: r["reserved"] or used(r))):
            evs = [(r["ts"], r["th"], value(r)) for r in rs]
            w = pair_check(evs, cap, cap / WINDOW_S)
            checks.append({"name": f"local {dim} {inst}", "ok": w["excess"] <= 1e-6, "text": (
                f"admitted locally {len(rs)}; worst run: {w['sum']:.0f} in {w['span']:.1f}s "
                f"vs ceil(L/2) + Δt·ceil(L/2)/W = {w['bound']:.0f} (excess {w['excess']:+.0f})")})
    # Concurrency.
    if HEAVY.get(label, {}).get("kind") == "slow-stream":
        worst_c, worst_raw = 0, 0
        for e in range(len(starts)):
            rs = [r for r in central if epoch_index(r["ts"], starts) == e and r["th"] is not None]
            best, _ = max_overlap([(r["th"], r["te"] - READ_LATENCY_MARGIN_S) for r in rs])
            raw, _ = max_overlap([(r["th"], r["te"]) for r in rs])
            worst_c, worst_raw = max(worst_c, best), max(worst_raw, raw)
        checks.append({"name": "central concurrency", "ok": worst_c <= CONC_LIMIT, "text": (
            f"most in flight at once (admitted by Redis, per Redis lifetime): {worst_c} "
            f"({worst_raw} without the {READ_LATENCY_MARGIN_S * 1000:.0f} ms read margin) vs C = {CONC_LIMIT}")})
        for inst, rs in sorted(by_inst.items()):
            best, _ = max_overlap([(r["th"], r["te"] - READ_LATENCY_MARGIN_S) for r in rs if r["th"] is not None])
            checks.append({"name": f"local concurrency {inst}", "ok": best <= loc_conc, "text": (
                f"most in flight at once, admitted locally: {best} vs ceil(C/2) = {loc_conc}")})
        allb, _ = max_overlap([(r["th"], r["te"] - READ_LATENCY_MARGIN_S) for r in adm if r["th"] is not None])
        checks.append({"name": "concurrency, all", "ok": True, "text": (
            f"most in flight at once, central and local together: {allb} "
            f"(bound C + C after a Redis restart + ceil(C/2) per Envoy process = up to "
            f"{2 * CONC_LIMIT + 3 * loc_conc})")})
    # Every window of W, all admissions together (report; implied by the checks above).
    for dim, cap, rate, value, loc in (("requests", REQ_LIMIT, r_req, lambda r: 1, loc_req),
                                       ("tokens", TOK_LIMIT, r_tok, used, loc_tok)):
        worst = None
        for r0 in adm:
            a, b = r0["ts"], r0["ts"] + WINDOW_S
            inwin = [r for r in adm if a <= r["ts"] < b]
            total = sum(value(r) for r in inwin)
            restarts = sum(1 for s in starts[1:] if a < s < b)
            insts = {r["inst"] for r in inwin if r["degraded"]}
            bound = (1 + restarts) * cap + rate * WINDOW_S + (pending(a) if dim == "tokens" else 0) + len(insts) * 2 * loc
            if worst is None or total - bound > worst[0] - worst[1]:
                worst = (total, bound, a, restarts, len(insts))
        if worst:
            checks.append({"name": f"any {WINDOW_S:g}s window, {dim}", "ok": worst[0] <= worst[1] + 1e-6, "text": (
                f"closest to its bound: {worst[0]:.0f} admitted from t={worst[2]:.1f}s (limit {cap}; bound "
                f"{worst[1]:.0f} with {worst[3]} Redis restart(s) and {worst[4]} local decider(s) in it)")})
    if under:
        checks.append({"name": "reservations cover usage", "ok": True, "text": (
            f"{len(under)} admitted request(s) used more than reserved (settled as a debit), e.g. "
            f"reserved {under[0]['reserved']} used {used(under[0])}")})
    return checks
