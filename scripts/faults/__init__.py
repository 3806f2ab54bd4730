"""Fault suite under sustained load: several minutes of traffic from a few hundred tenants
through two Envoys (each `--concurrency 2`) sharing one companion, while Redis is paused
(CLIENT PAUSE), the companion is killed and restarted, one Envoy is SIGKILLed and started
again, and Redis is restarted (killed and started empty on the same port: its data is
lost, as a cache's would be). Then it checks what the filter promised:

- no 5xx caused by the filter (goal 0): a 5xx is the mock's when it says so (it fails only
  requests that ask it to, with `x-mock-status`); a 503 `rate_limiter_unavailable`, or any
  other 5xx Envoy made itself, counts against the filter. Connection errors to the Envoy
  being killed are expected and counted apart; any other connection error is not.
- admissions within the limits' bounds, for each heavy tenant and each limit (below);
- Envoy's `/memory` (allocated, heap) for the Envoy never killed at start and end;
- after the traffic, every reservation settled (no `:res:` key 3 s after the last
  response) and then every slot and reservation gone (after `slots.ttl` and
  `tokens.reservation_ttl`); the companion healthy.

The bounds checked (token buckets, capacity L per window W, refill r = L/W):

- Central share: what Redis admitted (responses without `x-llm-ratelimit-degraded`) in any
  set of requests whose admissions lie in [a, b] is at most L + r·(b − a): the bucket holds
  at most L at a and refills r·(b − a). Admission times are bounded by the client's send
  and response-header times, the interval taken at its widest. Tokens count what was
  really charged after settlement (the usage the mock reports), plus the credits still to
  come at a for requests admitted before a (a credit returned inside [a, b] for a request
  charged before a is budget that was spent before a). A Redis restart loses every
  counter: the bound starts again at L then, so each Redis lifetime is checked alone.
- Local share (degraded mode, `failure_mode: local`, `fallback.instances: 2`): each
  Envoy process admits locally at most ceil(L/2) + ceil(L/2)/W·(b − a) in [a, b] (its own
  token bucket in shared data, charged the reservation, never credited). A restarted
  Envoy is a new process with a full local bucket.
- Concurrency C: central slots in flight at once (from the response headers to the last
  byte, less 20 ms of client read latency) at most C in each Redis lifetime (a restart
  forgets the slots of requests still in flight); locally at most ceil(C/2) per process.
  Streams are shorter than `slots.ttl`, so no live stream can lose its slot.
- Together, any window of W admits at most (1 + Redis restarts in it)·L + r·W + pending
  credits + 2·ceil(L/2) per Envoy process that decided locally in it (its full local
  bucket and a window's refill): docs/failures.md's "up to one extra window's budget across
  all proxies while Redis is unreachable". Reported per window; the two checks above
  are stricter (the sum of the two shares) and decide.

Run: .venv/bin/python scripts/faults [--minutes 4] [--workdir DIR]
Exit code 0 and `faults: PASS`, or 1 and `faults: FAIL`.

Modules: `settings` (the policy and the load), `traffic` (the clients and what each request
got), `inject` (the stack and the faults), `checks` (the bounds above, over the recorded
requests; unit-tested in tests/checks/test_faults_checks.py), `report` (what is printed, what
fails), `__main__` (the run).
"""
