"""What tests of several levels share, beyond the process harness (scripts/stack.py, shared
with the demo and the bench): Redis's clock, the companion's metrics, a tenant's queue.
A test module imports from here, never from another test module of another folder."""

from stack import http_get

COMPANION_PREFIX = "llm_ratelimit_companion_"


def redis_now_ms(client) -> float:
    """Redis's own clock (TIME), ms: the one every proxy shares."""
    time = client.time()
    if isinstance(time, dict):  # a cluster client asks every node: one machine, one clock
        time = next(iter(time.values()))
    seconds, micros = time
    return seconds * 1000 + micros / 1000


def companion_scrape(port: int, path: str = "/metrics") -> dict:
    """The companion's metrics: {'name{labels}': value}, labels as written."""
    status, body = http_get(f"http://127.0.0.1:{port}{path}")
    assert status == 200
    samples = {}
    for line in body.decode().splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            samples[series] = float(value)
    return samples


def companion_metric(samples: dict, name: str, **labels) -> float:
    """One series of the companion's; labels in any order (the exposition sorts none)."""
    wanted = {f'{k}="{v}"' for k, v in labels.items()}
    for series, value in samples.items():
        base, _, rest = series.partition("{")
        if base == COMPANION_PREFIX + name and set(filter(None, rest.rstrip("}").split(","))) == wanted:
            return value
    raise AssertionError(f"no series {name} {labels} in {sorted(samples)}")


def queue_waiters(store, tenant, domain: str = "llm") -> int:
    """How many of a tenant's requests wait in its queue in Redis now."""
    return store.zcard(f"llmrl:{{{domain}:{tenant}}}:queue:waiters")
