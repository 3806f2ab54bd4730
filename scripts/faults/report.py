"""The report: what the run saw, and the list of what failed."""

from __future__ import annotations

import json
from collections import Counter

from .checks import check_tenant, classify
from .settings import CONC_LIMIT, FILTER_CONFIG, HEAVY, INSTANCES, REQ_LIMIT, TOK_LIMIT, WINDOW_S


def fmt_bytes(n: int | None) -> str:
    return "n/a" if not n else f"{n / 1048576:.1f} MiB"



def print_report(rep: dict) -> list[str]:
    fails = []
    results, events = rep["results"], rep["events"]
    classify(results, events)
    print("\n================ llm-ratelimit fault suite ================")
    print(f"config: {json.dumps({k: v for k, v in FILTER_CONFIG.items() if k != 'companion'})}")
    print(f"        Redis restarts lose all state (no persistence), as a cache's restart would.")
    print(f"\nfaults ({len(events)}):")
    for e in events:
        if not e.get("kill"):
            print(f"  t={e['start']:6.1f}s .. {e['end']:6.1f}s  {e['what']}")
    for err in rep["errors"]:
        fails.append(f"fault step failed: {err}")

    print(f"\nrequests: {len(results)} in {rep['duration']:.0f}s "
          f"({len(results) / rep['duration']:.0f}/s), tenants: {len({r['tenant'] for r in results})}")
    by_cls = Counter(r["cls"] for r in results)
    for cls, n in sorted(by_cls.items(), key=lambda kv: -kv[1]):
        print(f"  {n:7d}  {cls}")
    per_envoy = Counter((r["inst"], r["cls"].split(" (")[0]) for r in results)
    print("  by Envoy process: " + ", ".join(f"{i} {c}: {n}" for (i, c), n in sorted(per_envoy.items())))

    filter_5xx = [r for r in results if r["cls"].endswith(("rate_limiter_unavailable", "Envoy/filter"))]
    print(f"\n5xx caused by the filter: {len(filter_5xx)} (goal 0)")
    for r in filter_5xx[:5]:
        print(f"    t={r['ts']:.2f}s {r['inst']} {r['tenant']} {r['status']} {r['body']!r}")
    if filter_5xx:
        fails.append(f"{len(filter_5xx)} 5xx caused by the filter")
    mock_unasked = [r for r in results if "NOT asked" in r["cls"]]
    if mock_unasked:
        fails.append(f"{len(mock_unasked)} mock errors nobody asked for")
    live_errors = [r for r in results if r["cls"].endswith("(live Envoy)")]
    print(f"connection errors: {sum(1 for r in results if r['cls'].endswith('(Envoy being killed)'))} "
          f"to the Envoy being killed (expected), {len(live_errors)} to a live Envoy")
    for r in live_errors[:5]:
        print(f"    t={r['ts']:.2f}s..{r['te']:.2f}s {r['inst']} {r['tenant']} {r['err']}")
    if live_errors:
        fails.append(f"{len(live_errors)} connection errors or truncated streams on a live Envoy")
    unexpected = [r for r in results if r["cls"].endswith("unexpected")]
    if unexpected:
        fails.append(f"{len(unexpected)} unexpected statuses, e.g. {unexpected[0]['status']} {unexpected[0]['body']!r}")
    degraded = sum(1 for r in results if r["degraded"])
    print(f"decided locally (x-llm-ratelimit-degraded): {degraded}")
    if not degraded:
        fails.append("no request was decided in the degraded mode: the faults did not bite")

    light = [r for r in results if r["tenant"].startswith("light")]
    light_429 = [r for r in light if r["status"] == 429]
    print(f"light tenants: {len(light)} requests, {len(light_429)} refused (their traffic is far below the limits)")
    for r in light_429[:3]:
        print(f"    t={r['ts']:.2f}s {r['inst']} {r['tenant']} degraded={r['degraded']} {r['body'][:160]!r}")

    print(f"\nbounds (L = {REQ_LIMIT} requests and {TOK_LIMIT} tokens per {WINDOW_S:g}s, C = {CONC_LIMIT} "
          f"in flight; fallback.instances = {INSTANCES}):")
    for label in HEAVY:
        recs = [r for r in results if r["tenant"] == label]
        st = Counter(r["cls"] for r in recs)
        print(f"  {label}: {len(recs)} sent, " + ", ".join(f"{n} {c}" for c, n in sorted(st.items(), key=lambda kv: -kv[1])))
        if not any(r["status"] == 429 for r in recs):
            fails.append(f"{label} was never refused: its bound was not exercised")
        for c in check_tenant(label, recs, events):
            print(f"    {'PASS' if c['ok'] else 'FAIL'}  {c['name']}: {c['text']}")
            if not c["ok"]:
                fails.append(f"{label}: {c['name']}: {c['text']}")

    start, warm, end, mem_b = rep["mem"]
    print("\nmemory, Envoy A (never killed), admin /memory:")
    for what, m in (("start", start), ("after warm-up", warm), ("end", end)):
        if m:
            print(f"  {what:14s} allocated {fmt_bytes(m['allocated'])}, heap {fmt_bytes(m['heap'])}, RSS {fmt_bytes(m['rss'])}")
    if start and end and start["allocated"]:
        print(f"  growth start→end: {fmt_bytes(end['allocated'] - start['allocated'])} allocated")
    if mem_b:
        print(f"  Envoy {mem_b['inst']} (restarted) at the end: allocated {fmt_bytes(mem_b['allocated'])}, RSS {fmt_bytes(mem_b['rss'])}")

    print("\nfilter counters (Envoy /stats):")
    for name, s in rep["stats"].items():
        keys = ["requests_allowed_total", "requests_limited_total", "degraded_decisions_total",
                "callout_failures_total", "settlements_failed_total", "shared_writes_refused_total",
                "tokens_reserved_total", "tokens_charged_total"]
        print(f"  {name}: " + ", ".join(f"{k} {s.get(k, '?')}" for k in keys))

    early, late = rep["early"], rep["late"]
    print("\nRedis after the traffic:")
    print(f"  3 s after the last reply: keys by kind {dict(early['kinds'])}; "
          f"unsettled reservations {len(early['res'])}, slot sets with members {len(early['slots'])}")
    for k, ttl in early["res"][:10]:
        print(f"    unsettled {k} (ttl {ttl} ms)")
    for k, n, ttl in early["slots"][:10]:
        print(f"    held slots {k}: {n} (ttl {ttl} ms)")
    print(f"  after reservation_ttl + slots.ttl: keys by kind {dict(late['kinds'])}; "
          f"reservations {len(late['res'])}, slot sets with members {len(late['slots'])}")
    if early["res"]:
        fails.append(f"{len(early['res'])} reservation(s) not settled 3 s after the last reply (companion healthy)")
    if early["slots"]:
        fails.append(f"{len(early['slots'])} slot set(s) still held 3 s after the last reply")
    if late["res"] or late["slots"]:
        fails.append(f"keys left after their TTLs: {len(late['res'])} reservations, {len(late['slots'])} slot sets")
    print(f"  companion /healthz: {rep['health']}; Envoys alive: {rep['alive']}")
    if rep["health"] != 200:
        fails.append(f"companion unhealthy at the end ({rep['health']})")
    if not all(rep["alive"].values()):
        fails.append(f"an Envoy died: {rep['alive']}")
    problems, given_up, timed_out = rep["log_problems"]
    print(f"  Envoy log lines at error/critical level or telling of a wasm failure: {len(problems)}")
    for line in problems[:8]:
        print(f"    {line}")
    if problems:
        fails.append("Envoy logged errors or a wasm failure (see the lines above)")
    print(f"  settlements the filter gave up after retries (Envoy warnings): {given_up}; companion settle calls "
          f"that timed out on Redis: {timed_out}")
    if given_up:
        print("    WARN: a settlement given up leaves its reservation to expire as charged (errs on the side of the")
        print("    limit); a reservation-less one (a local admission's debit or credit) is lost, and one the")
        print("    companion reported failed on a Redis timeout may have been applied and is then sent again.")
    return fails
