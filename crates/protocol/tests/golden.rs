//! Golden wire tests. The filter and the companion are upgraded at different times, so
//! every message, path and key name is pinned here as the other side sees it: a change
//! that breaks one of these breaks a mixed-version deployment.

use llm_ratelimit_protocol::keys::*;
use llm_ratelimit_protocol::plans::{PLAN_KIND, PLAN_NAME};
use llm_ratelimit_protocol::*;
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::fmt::Debug;

/// `value` serialises to exactly `json`, and `json` parses back to `value`.
fn pinned<T: Serialize + DeserializeOwned + PartialEq + Debug>(value: &T, json: &str) {
    assert_eq!(serde_json::to_string(value).expect("serialise"), json);
    assert_eq!(&serde_json::from_str::<T>(json).expect("parse"), value);
}

fn spec(name: &str, kind: LimitKind, min_cost: Option<u64>) -> LimitCharge {
    LimitCharge {
        owner: None,
        shadow: false,
        name: name.into(),
        capacity: 100,
        window_ms: 60_000,
        cost: 7,
        min_cost,
        kind,
        period_bounds_ms: Vec::new(),
        provisional: false,
        look_only: false,
        fair: None,
    }
}

#[test]
fn paths_and_the_token_header() {
    assert_eq!(
        [CHARGE_PATH, SETTLE_PATH, LEASE_PATH, TOUCH_PATH, RELEASE_PATH],
        ["/v1/token_bucket", "/v1/settle", "/v1/lease", "/v1/touch", "/v1/release"]
    );
    assert_eq!(TOKEN_HEADER, "x-llmrl-token");
    assert_eq!(HEALTH_PATH, "/healthz");
}

#[test]
fn charge_request() {
    let bare = ChargeRequest {
        domain: "llm".into(),
        tenant: "t1".into(),
        limits: vec![spec("rpm", LimitKind::TokenBucket, None)],
        reservation: None,
        wait: None,
    };
    pinned(
        &bare,
        r#"{"domain":"llm","tenant":"t1","limits":[{"name":"rpm","capacity":100,"window_ms":60000,"cost":7}]}"#,
    );
    let full = ChargeRequest {
        limits: vec![
            LimitCharge { provisional: true, ..spec("tpm", LimitKind::TokenBucket, Some(3)) },
            spec("sw", LimitKind::SlidingWindow, None),
            spec("cc", LimitKind::Slots, None),
        ],
        reservation: Some(Reservation { id: "abc1".into(), ttl_ms: 600_000 }),
        wait: Some(Wait { max_ms: 5_000, priority: 7, aging_ms: 1_000 }),
        ..bare
    };
    pinned(
        &full,
        concat!(
            r#"{"domain":"llm","tenant":"t1","limits":["#,
            r#"{"name":"tpm","capacity":100,"window_ms":60000,"cost":7,"min_cost":3,"provisional":true},"#,
            r#"{"name":"sw","capacity":100,"window_ms":60000,"cost":7,"kind":"sliding_window"},"#,
            r#"{"name":"cc","capacity":100,"window_ms":60000,"cost":7,"kind":"slots"}],"#,
            r#""reservation":{"id":"abc1","ttl_ms":600000},"wait":{"max_ms":5000,"priority":7,"aging_ms":1000}}"#
        ),
    );
}

#[test]
fn charge_of_a_fair_pool() {
    let claim = FairClaim { claimant: "t1".into(), weight: 3, max_claimants: 64, idle_ms: 60_000 };
    let pool =
        LimitCharge { owner: Some("all".into()), fair: Some(claim), ..spec("pool", LimitKind::TokenBucket, None) };
    let request =
        ChargeRequest { domain: "llm".into(), tenant: "t1".into(), limits: vec![pool], reservation: None, wait: None };
    pinned(
        &request,
        concat!(
            r#"{"domain":"llm","tenant":"t1","limits":[{"name":"pool","capacity":100,"window_ms":60000,"cost":7,"#,
            r#""owner":"all","fair":{"claimant":"t1","weight":3,"max_claimants":64,"idle_ms":60000}}]}"#
        ),
    );
}

#[test]
fn lease_request() {
    let lease = LeaseRequest {
        domain: "llm".into(),
        tenant: "t1".into(),
        limits: vec![LeaseAsk {
            owner: None,
            name: "tpm".into(),
            capacity: 100,
            window_ms: 60_000,
            wanted: 7,
            needed: Some(0),
            kind: LimitKind::TokenBucket,
            look_only: false,
        }],
        share: 0.5,
    };
    pinned(
        &lease,
        r#"{"domain":"llm","tenant":"t1","limits":[{"name":"tpm","capacity":100,"window_ms":60000,"cost":7,"min_cost":0}],"share":0.5}"#,
    );
}

/// A limit that does not apply to the request (another model or tier) is sent look-only;
/// limits that apply go out exactly as before the field existed.
#[test]
fn a_limit_that_does_not_apply_is_look_only() {
    let request = ChargeRequest {
        domain: "llm".into(),
        tenant: "t1".into(),
        limits: vec![
            spec("rpm", LimitKind::TokenBucket, None),
            LimitCharge { cost: 0, look_only: true, ..spec("tpm_gpt4o", LimitKind::SlidingWindow, None) },
        ],
        reservation: None,
        wait: None,
    };
    pinned(
        &request,
        concat!(
            r#"{"domain":"llm","tenant":"t1","limits":["#,
            r#"{"name":"rpm","capacity":100,"window_ms":60000,"cost":7},"#,
            r#"{"name":"tpm_gpt4o","capacity":100,"window_ms":60000,"cost":0,"kind":"sliding_window","look_only":true}]}"#
        ),
    );
    let lease = LeaseRequest {
        domain: "llm".into(),
        tenant: "t1".into(),
        limits: vec![LeaseAsk {
            owner: None,
            name: "tpm_gpt4o".into(),
            capacity: 100,
            window_ms: 60_000,
            wanted: 0,
            needed: Some(0),
            kind: LimitKind::TokenBucket,
            look_only: true,
        }],
        share: 0.5,
    };
    pinned(
        &lease,
        r#"{"domain":"llm","tenant":"t1","limits":[{"name":"tpm_gpt4o","capacity":100,"window_ms":60000,"cost":0,"min_cost":0,"look_only":true}],"share":0.5}"#,
    );
}

#[test]
fn settle_request_and_reply() {
    let adjustment = |kind| Adjustment {
        owner: None,
        name: "tpm".into(),
        capacity: 100,
        window_ms: 60_000,
        credit: -5,
        kind,
        period_bounds_ms: Vec::new(),
    };
    let request = SettlementBatch {
        settlements: vec![
            Settlement {
                domain: "llm".into(),
                tenant: "t1".into(),
                reservation: Some("abc1".into()),
                once: None,
                limits: vec![adjustment(LimitKind::TokenBucket), adjustment(LimitKind::Slots)],
                cancel: true,
                stand_in: None,
            },
            Settlement {
                domain: "llm".into(),
                tenant: "t2".into(),
                reservation: None,
                once: Some("f00d1".into()),
                limits: vec![adjustment(LimitKind::SlidingWindow)],
                cancel: false,
                stand_in: None,
            },
        ],
    };
    pinned(
        &request,
        concat!(
            r#"{"settlements":[{"domain":"llm","tenant":"t1","reservation":"abc1","limits":["#,
            r#"{"name":"tpm","capacity":100,"window_ms":60000,"credit":-5},"#,
            r#"{"name":"tpm","capacity":100,"window_ms":60000,"credit":-5,"kind":"slots"}],"cancel":true},"#,
            r#"{"domain":"llm","tenant":"t2","once":"f00d1","limits":["#,
            r#"{"name":"tpm","capacity":100,"window_ms":60000,"credit":-5,"kind":"sliding_window"}]}]}"#
        ),
    );
    let reply =
        SettleReply { results: vec![SettleOutcome::Applied, SettleOutcome::AlreadySettled, SettleOutcome::Failed] };
    pinned(&reply, r#"{"results":["applied","already_settled","failed"]}"#);
}

#[test]
fn charge_reply() {
    let outcome = |status, charged| LimitOutcome {
        name: "rpm".into(),
        status,
        limit: 5,
        remaining: 2,
        reset_after_ms: 60_000,
        retry_after_ms: 12_000,
        charged,
    };
    let allowed =
        LimitsReply { allowed: true, waited_ms: 0, limits: vec![outcome(LimitStatus::Allowed, 1)], suspended: None };
    pinned(
        &allowed,
        r#"{"allowed":true,"limits":[{"name":"rpm","status":"allowed","limit":5,"remaining":2,"reset_after_ms":60000,"retry_after_ms":12000,"charged":1}]}"#,
    );
    let refused = LimitsReply {
        allowed: false,
        waited_ms: 250,
        limits: vec![outcome(LimitStatus::Limited, 0), outcome(LimitStatus::Never, 0)],
        suspended: None,
    };
    pinned(
        &refused,
        concat!(
            r#"{"allowed":false,"waited_ms":250,"limits":["#,
            r#"{"name":"rpm","status":"limited","limit":5,"remaining":2,"reset_after_ms":60000,"retry_after_ms":12000,"charged":0},"#,
            r#"{"name":"rpm","status":"never","limit":5,"remaining":2,"reset_after_ms":60000,"retry_after_ms":12000,"charged":0}]}"#
        ),
    );
    let suspended = LimitsReply {
        allowed: false,
        waited_ms: 0,
        limits: Vec::new(),
        suspended: Some(Suspension { limit: "rpm".into(), reason: "key leaked".into() }),
    };
    pinned(&suspended, r#"{"allowed":false,"limits":[],"suspended":{"limit":"rpm","reason":"key leaked"}}"#);
    // An older companion that does not send `charged` is still understood.
    let old = r#"{"allowed":true,"limits":[{"name":"rpm","status":"allowed","limit":5,"remaining":2,"reset_after_ms":1,"retry_after_ms":0}]}"#;
    assert_eq!(serde_json::from_str::<LimitsReply>(old).expect("parse").limits[0].charged, 0);
}

#[test]
fn redis_keys() {
    let kinds = [LimitKind::TokenBucket, LimitKind::SlidingWindow, LimitKind::Slots].map(LimitKind::script_name);
    assert_eq!(kinds, ["tb", "sw", "slots"]);
    assert_eq!(redis_key("llmrl:", "llm", "t1", "tb", "rpm"), "llmrl:{llm:t1}:tb:rpm");
    assert_eq!(redis_key("llmrl:", "llm", "t1", RESERVATION_KIND, "abc1"), "llmrl:{llm:t1}:res:abc1");
    assert_eq!(redis_key("llmrl:", "llm", "t1", CANCEL_KIND, "abc1"), "llmrl:{llm:t1}:cancel:abc1");
    assert_eq!(redis_key("llmrl:", "llm", "t1", ONCE_KIND, "f00d1"), "llmrl:{llm:t1}:once:f00d1");
    assert_eq!(redis_key("llmrl:", "llm", "t1", PLAN_KIND, PLAN_NAME), "llmrl:{llm:t1}:plan:limits");
    assert_eq!(redis_key("llmrl:", "llm", "t1", QUEUE_KIND, QUEUE_NAME), "llmrl:{llm:t1}:queue:waiters");
    assert_eq!(
        redis_key("llmrl:", "llm", CALIBRATION_TENANT, CALIBRATION_KIND, CALIBRATION_NAME),
        "llmrl:{llm:models}:cal:rules"
    );
}

#[test]
fn calibration_exchange() {
    assert_eq!(CALIBRATION_PATH, "/v1/calibration");
    let exchange = CalibrationExchange {
        domain: "llm".into(),
        rules: vec![
            RuleSamples { rule: "00112233aabbccdd".into(), prompt_ratios: vec![2.3125, 1.5], outputs: vec![40.0] },
            RuleSamples { rule: "ffeeddcc00112233".into(), prompt_ratios: vec![], outputs: vec![] },
        ],
    };
    pinned(
        &exchange,
        concat!(
            r#"{"domain":"llm","rules":[{"rule":"00112233aabbccdd","prompt_ratios":[2.3125,1.5],"outputs":[40.0]},"#,
            r#"{"rule":"ffeeddcc00112233"}]}"#
        ),
    );
    assert_eq!(exchange.validate(), Ok(()));
    let bad = |rule: RuleSamples| CalibrationExchange { domain: "llm".into(), rules: vec![rule] }.validate();
    let rule = |id: &str, ratios: Vec<f64>| RuleSamples { rule: id.into(), prompt_ratios: ratios, outputs: vec![] };
    assert!(bad(rule("xyz", vec![])).is_err_and(|e| e.contains("rules[0].rule")));
    assert!(bad(rule("00112233aabbccdd", vec![f64::NAN])).is_err_and(|e| e.contains("prompt_ratios")));
    assert!(bad(rule("00112233aabbccdd", vec![-1.0])).is_err());
    assert!(bad(rule("00112233aabbccdd", vec![1.0; MAX_SAMPLES_PER_EXCHANGE + 1])).is_err());
    let reply = CalibrationReply {
        rules: vec![
            RuleFigures {
                rule: "00112233aabbccdd".into(),
                prompt_ratio: Some(RunningFigure { mean: 2.0, deviation: 0.25, samples: 3 }),
                output: None,
            },
            RuleFigures { rule: "ffeeddcc00112233".into(), prompt_ratio: None, output: None },
        ],
    };
    pinned(
        &reply,
        concat!(
            r#"{"rules":[{"rule":"00112233aabbccdd","prompt_ratio":{"mean":2.0,"deviation":0.25,"samples":3}},"#,
            r#"{"rule":"ffeeddcc00112233"}]}"#
        ),
    );
}

#[test]
fn redis_keys_as_the_python_harness_names_them() {
    // tests/cases/keys.json is read by tests/checks/test_keys.py too.
    let table: serde_json::Value =
        serde_json::from_str(include_str!("../../../tests/cases/keys.json")).expect("keys.json");
    let cases = table["redis"].as_array().expect("redis cases");
    assert!(!cases.is_empty());
    for case in cases {
        let part = |field: &str| case[field].as_str().expect(field).to_string();
        let key = redis_key(&part("prefix"), &part("domain"), &part("tenant"), &part("kind"), &part("name"));
        assert_eq!(key, part("key"));
    }
}

#[test]
fn shared_data_keys() {
    assert_eq!(lease_key("llm", 7), "llmrl.lease.llm.7");
    assert_eq!(local_key("llm", 7), "llmrl.local.llm.7");
    assert_eq!(queued_key("llm"), "llmrl.queued.llm");
    assert_eq!(breaker_key("llm"), "llmrl.breaker.llm");
    assert_eq!(vm_numbers_key("llm"), "llmrl.vms.llm");
    assert_eq!(average_key("llm", 7), "llmrl.avg.llm.7");
    assert_eq!(calibration_key("llm", 3), "llmrl.cal.llm.3");
}

#[test]
fn usage_and_reset_paths() {
    assert_eq!([USAGE_PATH, RESET_PATH], ["/v1/usage", "/v1/admin/reset"]);
}

#[test]
fn usage_and_reset_request() {
    let query = TenantLimits {
        domain: "llm".into(),
        tenant: "t1".into(),
        limits: vec![
            LimitSpec {
                name: "rpm".into(),
                capacity: 20,
                window_ms: 60_000,
                kind: LimitKind::TokenBucket,
                period_bounds_ms: Vec::new(),
            },
            LimitSpec {
                name: "tpm".into(),
                capacity: 10_000,
                window_ms: 60_000,
                kind: LimitKind::SlidingWindow,
                period_bounds_ms: Vec::new(),
            },
            LimitSpec {
                name: "inflight".into(),
                capacity: 4,
                window_ms: 30_000,
                kind: LimitKind::Slots,
                period_bounds_ms: Vec::new(),
            },
        ],
    };
    pinned(
        &query,
        concat!(
            r#"{"domain":"llm","tenant":"t1","limits":["#,
            r#"{"name":"rpm","capacity":20,"window_ms":60000},"#,
            r#"{"name":"tpm","capacity":10000,"window_ms":60000,"kind":"sliding_window"},"#,
            r#"{"name":"inflight","capacity":4,"window_ms":30000,"kind":"slots"}]}"#
        ),
    );
    assert_eq!(query.validate(), Ok(()));
    let unknown = r#"{"domain":"llm","tenant":"t1","limits":[{"name":"rpm","capacity":1,"window_ms":1,"cost":1}]}"#;
    assert!(serde_json::from_str::<TenantLimits>(unknown).is_err(), "a cost is not part of a query");
    let mut bad = query.clone();
    bad.tenant = "{t1}".into();
    assert!(bad.validate().is_err_and(|e| e.contains("tenant")));
}

#[test]
fn usage_and_reset_replies() {
    let usage = UsageReply {
        limits: vec![
            LimitUsage {
                name: "rpm".into(),
                kind: LimitKind::TokenBucket,
                limit: 20,
                remaining: 17,
                used: 3,
                reset_after_ms: 9_000,
                retry_after_ms: 0,
            },
            LimitUsage {
                name: "inflight".into(),
                kind: LimitKind::Slots,
                limit: 4,
                remaining: 0,
                used: 4,
                reset_after_ms: 0,
                retry_after_ms: 800,
            },
        ],
        reservations: 3,
        reservations_complete: true,
    };
    pinned(
        &usage,
        concat!(
            r#"{"limits":[{"name":"rpm","limit":20,"remaining":17,"used":3,"reset_after_ms":9000,"retry_after_ms":0},"#,
            r#"{"name":"inflight","kind":"slots","limit":4,"remaining":0,"used":4,"reset_after_ms":0,"retry_after_ms":800}],"#,
            r#""reservations":3,"reservations_complete":true}"#
        ),
    );
    pinned(&ResetReply { deleted: 2 }, r#"{"deleted":2}"#);
}
