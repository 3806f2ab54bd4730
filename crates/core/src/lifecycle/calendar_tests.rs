//! The lifecycle on the fake host for calendar budgets (issue 22): charged with the
//! period boundaries of the decision's clock, settled within the period, refused until
//! the period's end (which every header says), and full again at local midnight on the
//! 1st, on both hosts.

use super::tests::{config, settle};
use crate::effects::host::HostKind;
use crate::protocol::{ChargeRequest, LimitKind};
use crate::testing::{advance, usage_reply, FakeCompanion, InFlight, Proxy, Request, World};
use serde_json::json;

const HOSTS: [HostKind; 2] = [HostKind::Envoy, HostKind::Nginx];
const CHAT: &str = r#"{"model":"gpt-4o","messages":[{"role":"user","content":"hello world"}],"max_tokens":300}"#;
/// What CHAT reserves: 9 prompt tokens counted in the proxy, 300 of output allowance.
const CHAT_RESERVES: u64 = 309;

/// Milliseconds of an RFC 3339 instant (the boundaries as Amsterdam's clocks show them).
fn ms(rfc3339: &str) -> u64 {
    let at: jiff::Timestamp = rfc3339.parse().expect("an instant");
    at.as_millisecond() as u64
}

fn header<'a>(flight: &'a InFlight, name: &str) -> Option<&'a str> {
    match flight.replied() {
        Some(reply) => reply.headers.iter().find(|(n, _)| *n == name).map(|(_, v)| v.as_str()),
        None => flight.host.response_header_value(name),
    }
}

#[test]
fn a_monthly_budget_is_spent_settled_and_full_again_at_local_midnight_on_the_1st() {
    for kind in HOSTS {
        let world = World::new(kind);
        // 23:59 on 28 February 2027 in Amsterdam (CET): March starts in a minute.
        world.borrow_mut().now_ms = ms("2027-02-28T22:59:00Z");
        let limits = json!([{"name": "monthly", "tokens": 600,
                             "window": {"calendar": "month", "time_zone": "Europe/Amsterdam"}}]);
        let mut proxy = Proxy::new(&world, &config(limits, json!({"headers": ["openai", "anthropic", "ietf"]})));
        let mut companion = FakeCompanion::default();

        let mut first = proxy.send(Request::chat("sk-a", CHAT), &mut companion);
        assert!(first.forwarded(), "{kind:?}");
        let charge: ChargeRequest = serde_json::from_value(first.host.last_callout().body.clone()).expect("a charge");
        assert_eq!(charge.limits[0].kind, LimitKind::Calendar);
        let months = ["2027-01-01T00:00:00+01:00", "2027-02-01T00:00:00+01:00", "2027-03-01T00:00:00+01:00"];
        let expected: Vec<u64> = months.iter().chain(&["2027-04-01T00:00:00+02:00"]).map(|m| ms(m)).collect();
        assert_eq!(charge.limits[0].period_bounds_ms, expected, "{kind:?}");
        // Settled within the month: 50 tokens used of 309 reserved.
        proxy.reply(&mut first, 200, "application/json", &[&usage_reply(9, 41)]);
        // Every header says the budget resets in a minute, at midnight.
        assert_eq!(header(&first, "x-ratelimit-remaining-tokens"), Some("291"));
        assert_eq!(header(&first, "x-ratelimit-reset-tokens"), Some("1m0s"));
        assert_eq!(header(&first, "anthropic-ratelimit-tokens-reset"), Some("2027-02-28T23:00:00Z"));
        // February 2027 has 28 days.
        assert_eq!(header(&first, "ratelimit-policy"), Some("\"monthly\";q=600;w=2419200"));
        assert_eq!(header(&first, "ratelimit"), Some("\"monthly\";r=291;t=60"));

        let settled = settle(&mut proxy, &mut companion);
        assert_eq!(settled[0].limits[0].credit, CHAT_RESERVES as i64 - 50);
        assert_eq!(settled[0].limits[0].period_bounds_ms, expected, "{kind:?}");
        assert_eq!(companion.level(&charge.tenant, &charge.limits[0], proxy.now()), 550.0, "{kind:?}");

        // Spent: requests in flight (the estimates now follow the learned completions)
        // take the rest, and the first refusal comes half a minute before midnight.
        advance(&world, 30_000);
        let mut in_flight = Vec::new();
        let refused = loop {
            let flight = proxy.send(Request::chat("sk-a", CHAT), &mut companion);
            if !flight.forwarded() {
                break flight;
            }
            in_flight.push(flight);
            assert!(in_flight.len() < 20, "{kind:?}: a budget of 600 tokens is spent by 20 requests");
        };
        assert_eq!(refused.replied().map(|r| r.status), Some(429), "{kind:?}");
        // Not a refill: nothing comes back before the month's end, 30 s away.
        assert_eq!(header(&refused, "retry-after"), Some("30"));
        let message = refused.replied().map(|r| r.body.clone()).unwrap_or_default();
        assert!(message.contains("per calendar month (Europe/Amsterdam)"), "{message}");

        // At midnight, to the millisecond, March's budget is whole; March 2027 is 31 days
        // less the hour of the change to summer time (28 March).
        advance(&world, 29_999);
        assert_eq!(proxy.send(Request::chat("sk-a", CHAT), &mut companion).replied().map(|r| r.status), Some(429));
        advance(&world, 1);
        let mut march = proxy.send(Request::chat("sk-a", CHAT), &mut companion);
        assert!(march.forwarded(), "{kind:?}: full again at the boundary");
        let reserved = serde_json::from_value::<ChargeRequest>(march.host.last_callout().body.clone())
            .expect("a charge")
            .limits[0]
            .cost;
        proxy.reply(&mut march, 200, "application/json", &[&usage_reply(9, 41)]);
        let whole_but_this = (600 - reserved).to_string();
        assert_eq!(header(&march, "x-ratelimit-remaining-tokens"), Some(whole_but_this.as_str()));
        assert_eq!(header(&march, "ratelimit-policy"), Some("\"monthly\";q=600;w=2674800"));
        assert_eq!(header(&march, "anthropic-ratelimit-tokens-reset"), Some("2027-03-31T22:00:00Z"));
    }
}

/// Spent in mid-month, a calendar budget is refused for good (issue 45): a spent quota
/// that says not to retry, with the status `refusals.spent_status` sets and `Retry-After`
/// the month's end; before that, admitted responses warned of it once below
/// `refusals.warn_below` of the budget.
#[test]
fn a_budget_spent_for_the_rest_of_the_month_says_not_to_retry_and_was_warned_of() {
    for kind in HOSTS {
        let world = World::new(kind);
        world.borrow_mut().now_ms = ms("2027-02-15T12:00:00Z");
        let limits = json!([{"name": "monthly", "tokens": 1000,
                             "window": {"calendar": "month", "time_zone": "Europe/Amsterdam"}}]);
        let refusals = json!({"refusals": {"warn_below": 0.5, "spent_status": 403}});
        let mut proxy = Proxy::new(&world, &config(limits, refusals));
        let mut companion = FakeCompanion::default();
        let mut warned = Vec::new();
        let refused = loop {
            let mut flight = proxy.send(Request::chat("sk-a", CHAT), &mut companion);
            if !flight.forwarded() {
                break flight;
            }
            proxy.reply(&mut flight, 200, "application/json", &[&usage_reply(9, 300)]);
            warned.push(header(&flight, "x-llm-ratelimit-budget-low").map(str::to_string));
            assert!(warned.len() < 10, "{kind:?}: a budget of 1000 tokens is spent by 10 requests");
        };
        // 309 reserved each: 691 left after the first, then less than half.
        assert_eq!(warned[0], None, "{kind:?}");
        assert!(
            warned.len() >= 2 && warned[1..].iter().all(|w| w.as_deref() == Some("monthly")),
            "{kind:?}: {warned:?}"
        );
        let reply = refused.replied().expect("a local reply");
        assert_eq!(reply.status, 403, "{kind:?}");
        assert_eq!(header(&refused, "x-should-retry"), Some("false"), "{kind:?}");
        // Midnight in Amsterdam on 1 March: 13 days and 11 hours away.
        assert_eq!(header(&refused, "retry-after"), Some("1162800"), "{kind:?}");
        assert_eq!(header(&refused, "retry-after-ms"), None, "{kind:?}");
        let body: serde_json::Value = serde_json::from_str(&reply.body).expect("a JSON body");
        assert_eq!(
            (body["error"]["type"].as_str(), body["error"]["code"].as_str()),
            (Some("insufficient_quota"), Some("insufficient_quota"))
        );
        let message = body["error"]["message"].as_str().unwrap_or_default();
        assert!(
            message.contains("full again when the calendar month (Europe/Amsterdam) ends, at 2027-02-28T23:00:00Z"),
            "{message}"
        );
    }
}

/// A reply settled after the period it was charged in ended corrects nothing: that
/// budget is gone, and the new one owes nothing for it.
#[test]
fn a_settlement_after_the_boundary_leaves_the_new_period_whole() {
    for kind in HOSTS {
        let world = World::new(kind);
        world.borrow_mut().now_ms = ms("2026-12-31T23:59:59Z");
        let limits = json!([{"name": "daily", "tokens": 1000, "window": "day"}]);
        let mut proxy = Proxy::new(&world, &config(limits, json!({})));
        let mut companion = FakeCompanion::default();
        let mut flight = proxy.send(Request::chat("sk-a", CHAT), &mut companion);
        let charge: ChargeRequest = serde_json::from_value(flight.host.last_callout().body.clone()).expect("a charge");
        // 2027-01-01 begins; its first request is charged against a whole day.
        advance(&world, 2_000);
        let next_day = proxy.send(Request::chat("sk-a", CHAT), &mut companion);
        let taken = serde_json::from_value::<ChargeRequest>(next_day.host.last_callout().body.clone())
            .expect("a charge")
            .limits[0]
            .cost;
        // Then the old day's reply settles, 259 tokens under its reservation.
        proxy.reply(&mut flight, 200, "application/json", &[&usage_reply(9, 41)]);
        let settled = settle(&mut proxy, &mut companion);
        assert_eq!(settled.len(), 1, "{kind:?}: the settlement is sent");
        assert_eq!(settled[0].limits[0].credit, 309 - 50);
        let dated = crate::protocol::LimitCharge {
            period_bounds_ms: settled[0].limits[0].period_bounds_ms.clone(),
            ..charge.limits[0].clone()
        };
        let level = companion.level(&charge.tenant, &dated, proxy.now());
        assert_eq!(level, (1000 - taken) as f64, "{kind:?}: the credit of 2026-12-31 is not 2027-01-01's");
    }
}

/// With the companion away (`failure_mode: "local"`), a calendar budget is held per proxy
/// at its share (`fallback.instances`), by the proxy's clock, full again at the same
/// boundary (docs/configuration.md#calendar-budgets).
#[test]
fn without_the_companion_a_calendar_budget_is_held_at_the_proxys_share_until_its_boundary() {
    for kind in HOSTS {
        let world = World::new(kind);
        // 23:59:50 on 1 March 2027 in Amsterdam (CET): the day ends in 10 s.
        world.borrow_mut().now_ms = ms("2027-03-01T22:59:50Z");
        let limits = json!([{"name": "daily", "requests": 6,
                             "window": {"calendar": "day", "time_zone": "Europe/Amsterdam"}}]);
        let extra = json!({"failure_mode": "local", "fallback": {"instances": 2}});
        let mut proxy = Proxy::new(&world, &config(limits, extra));
        let mut away = FakeCompanion::failing(503);
        let mut admitted =
            || (0..5).filter(|_| proxy.send(Request::get("sk-a", "/v1/models"), &mut away).forwarded()).count();
        assert_eq!(admitted(), 3, "{kind:?}: half of the day's 6");
        advance(&world, 9_000);
        assert_eq!(admitted(), 0, "{kind:?}: still the same day by the proxy's clock");
        advance(&world, 1_000);
        assert_eq!(admitted(), 3, "{kind:?}: a new day at midnight in Amsterdam, whole again");
    }
}
