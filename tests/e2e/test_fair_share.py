"""Fair shares of a scarce pool (`limits[].fair_share`), end to end: 3 Envoys, each with
its own companion, one Redis, the mock upstream. The scenario of `make fairness`
(scripts/fairness.py: one tenant offering 10 times the pool, nine offering 5% each),
on a shorter clock: a pool of 2,000 tokens per 20 s for 40 s.

Without fair shares the heavy tenant takes the pool as fast as it refills and the light
ones are refused (`fair=False` below shows it, docs/benchmark.md#fair-shares quotes
both)."""

import time

import pytest

from fairness import COMPLETION, Fleet, measure, offer, pool_limits

POOL, WINDOW_S, SECONDS = 2000, 20, 40


@pytest.fixture
def fleet(stack):
    return Fleet(stack)


def test_every_light_tenant_gets_what_it_asks_and_the_heavy_one_the_rest(fleet):
    ports = fleet.envoys(pool_limits(POOL, WINDOW_S, fair=True))
    m = measure(ports, POOL, WINDOW_S, heavy=10, light=9, light_share=0.05, seconds=SECONDS)
    print(f"\nfair shares, {SECONDS} s: lights refused {m['light_refused']} of {m['light_sent']}, heavy got "
          f"{m['got'][m['heavy']]:.0f} (fair {m['fair'][m['heavy']]:.0f}), Jain {m['jain']:.3f}, admitted "
          f"{m['total']:.0f} of {m['supply']:.0f}, beyond refill {m['beyond_refill']:.0f}")
    assert set(m["statuses"]) <= {200, 429}, m["statuses"]
    assert m["light_sent"] >= 9 * 2 - 1, "each light tenant sent about two requests"
    assert m["light_refused"] == 0, "every light tenant gets all it asks for"
    # The heavy tenant gets the rest, but for the reserve it must leave in the pool (a
    # request of each light tenant), which is still there at the end: within 10% of the
    # supply (a loaded machine's requests come late).
    heavy = m["got"][m["heavy"]]
    assert heavy >= m["fair"][m["heavy"]] - m["reserve"] - 0.1 * m["supply"], m
    assert m["jain"] >= 0.95, m
    # Never over-admitted: a bucket admits at most its capacity beyond its refill.
    assert m["beyond_refill"] <= POOL, m


def test_without_fair_shares_the_heavy_tenant_takes_the_pool(fleet):
    """The same load on the same pool, first come, first served: the light tenants are
    refused, so the test above would fail without `fair_share`."""
    ports = fleet.envoys(pool_limits(POOL, WINDOW_S, fair=False))
    m = measure(ports, POOL, WINDOW_S, heavy=10, light=9, light_share=0.05, seconds=SECONDS / 2)
    assert m["light_refused"] > 0, m
    assert m["beyond_refill"] <= POOL, m


def teams_got(ports, seconds):
    """Team "many" (nine keys, each offering 0.3 of the pool's refill) and team "one" (one
    key offering 1.5 of it), each key sending its team's `x-team-id`: the tokens each team
    got, and what the pool supplied over the run."""
    per_second = POOL / WINDOW_S
    tag = f"{time.monotonic_ns():x}"
    teams = {f"sk-many-{i}-{tag}": ("many", 0.3 * per_second) for i in range(9)}
    teams[f"sk-one-{tag}"] = ("one", 1.5 * per_second)
    results = offer(ports, {key: rate for key, (_, rate) in teams.items()}, seconds, COMPLETION + 9,
                    headers={key: {"x-team-id": team} for key, (team, _) in teams.items()})
    got = {"many": 0.0, "one": 0.0}
    for key, replies in results.items():
        assert {status for _, status, _ in replies} <= {200, 429}, replies
        got[teams[key][0]] += sum(used for _, _, used in replies)
    return got, POOL + per_second * seconds


def test_shares_between_teams_go_to_each_team_not_to_each_key(fleet):
    """`fair_share.between` a team header: a team of nine keys and a team of one key,
    both asking more than half the pool, each get about half (max-min between the two
    teams: 0.5 each of what the pool supplied); between tenants (the default) the one key
    would get a tenth, as the control below shows."""
    ports = fleet.envoys(pool_limits(POOL, WINDOW_S, fair=True, between={"header": "x-team-id"}))
    got, supply = teams_got(ports, SECONDS * 3 / 4)
    print(f"\nbetween teams: team one got {got['one']:.0f}, team many {got['many']:.0f} of {supply:.0f}")
    # Within 10% of the supply of a half each (a loaded machine's requests come late).
    assert got["one"] >= 0.4 * supply and got["many"] >= 0.4 * supply, (got, supply)
    assert sum(got.values()) <= supply, "never over-admitted"


def test_shares_between_tenants_give_a_nine_key_team_nine_shares(fleet):
    """The control: the same teams, shares between tenants: the one key is one claimant
    of ten and gets about a tenth, so the test above fails without `between`."""
    ports = fleet.envoys(pool_limits(POOL, WINDOW_S, fair=True))
    got, supply = teams_got(ports, SECONDS / 2)
    print(f"\nbetween tenants: team one got {got['one']:.0f}, team many {got['many']:.0f} of {supply:.0f}")
    assert got["one"] <= 0.25 * supply, (got, supply)


def test_the_measures_are_what_they_say():
    """The scenario's arithmetic (scripts/fairness.py), on numbers worked by hand."""
    from fairness import jain, max_min, most_beyond_refill

    # 10,000 supplied: nine asking 500 get it, the heavy one the 5,500 left.
    demands = {"heavy": 100_000, **{f"light-{i}": 500 for i in range(9)}}
    fair = max_min(demands, 10_000)
    assert fair["heavy"] == 5_500 and all(fair[f"light-{i}"] == 500 for i in range(9))
    assert max_min({"a": 800, "b": 800}, 1000) == {"a": 500, "b": 500}
    assert jain([1] * 10) == 1 and jain([1] + [0] * 9) == pytest.approx(0.1)
    # A bucket of 100 refilling 10/s: 100 at once, then 10 a second, is within; 100 at
    # once twice a second apart is 190 beyond the refill.
    assert most_beyond_refill([(0, 100)] + [(t, 10) for t in range(1, 10)], 10) == pytest.approx(100)
    assert most_beyond_refill([(0, 100), (1, 100)], 10) == pytest.approx(190)
