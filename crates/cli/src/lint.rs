//! What `check-config` says beyond the filter's own validation: configs the filter loads
//! but that would hang or silently not do what they say on a given host (failures), and
//! configs that load and work but are probably not what was meant (warnings, failures
//! with `--strict`). Each finding names the fields concerned and what to do.

use llm_ratelimit_core::config::{FailureMode, Measure, Policy, TokenCount};
use llm_ratelimit_core::effects::host::HostKind;
use serde_json::Value;
use std::time::Duration;

/// Stock nginx reads its config in a 4,096-byte buffer and refuses a directive argument
/// that does not fit in it ("too long parameter"); the argument is the JSON between its
/// two quotes.
pub const NGINX_LONGEST_ARGUMENT: usize = 4096 - 2;

/// Where an embedded config sits, as far as it changes what the filter can do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plugin {
    /// An Envoy `PluginConfig`, with its `allow_on_headers_stop_iteration` as written.
    Envoy { allow_on_headers_stop_iteration: bool },
    /// Somewhere the plugin's own options are not visible (a bare config, Istio, Envoy
    /// Gateway): only the policy and the host are checked.
    Unknown,
}

/// Combinations the filter accepts but that hang every request or are silently ignored
/// on `host`.
pub fn failures(policy: &Policy, config: &[u8], host: HostKind, plugin: Plugin) -> Vec<String> {
    let mut found = Vec::new();
    let holds_headers = policy.hold_request_headers.unwrap_or(true) && host.reads_body_while_headers_wait();
    if let Plugin::Envoy { allow_on_headers_stop_iteration: false } = plugin {
        if holds_headers && policy.reads_body() {
            found.push(
                "this policy reads the request body before deciding (a token or cost limit, or a limit with \
                 `models`) and holds the headers meanwhile, but the Wasm filter's `config` has no \
                 `allow_on_headers_stop_iteration: true`: Envoy then delivers no body to a paused request and \
                 every such request hangs. Add `allow_on_headers_stop_iteration: true` beside `vm_config` \
                 (Envoy >= 1.35), or set `hold_request_headers: false` in the filter config"
                    .to_string(),
            );
        }
    }
    if !holds_headers {
        let why = if host.reads_body_while_headers_wait() {
            "`hold_request_headers` is false".to_string()
        } else {
            format!("{} never holds the request headers while the body is read", host.name())
        };
        for (field, on) in [
            // On by default, and harmless where it cannot apply (a stream without usage is
            // then charged by `tokens.hidden_output_models`): flagged only when written.
            (
                "tokens.request_stream_usage",
                serde_json::from_slice::<serde_json::Value>(config)
                    .ok()
                    .and_then(|c| c.pointer("/tokens/request_stream_usage").and_then(serde_json::Value::as_bool))
                    .unwrap_or(false),
            ),
            ("tokens.clamp_max_tokens", policy.tokens.clamp_max_tokens),
        ] {
            if on {
                found.push(format!(
                    "field `{field}` is true, but {why}: the body can only be rewritten while the headers are \
                     held, so it would silently not apply; remove it"
                ));
            }
        }
    }
    let written = config.trim_ascii();
    if host == HostKind::Nginx && written.len() > NGINX_LONGEST_ARGUMENT {
        found.push(format!(
            "the filter config is {} bytes; stock nginx refuses a directive argument longer than {} bytes \
             (\"too long parameter\"), so `proxy_wasm` would not load it: shorten it (drop defaults, spaces)",
            written.len(),
            NGINX_LONGEST_ARGUMENT
        ));
    }
    found
}

/// Settings that load and work, but are probably not what was meant. `written` is the
/// config as written (to tell a default from a value chosen on purpose).
pub fn warnings(policy: &Policy, written: &Value) -> Vec<String> {
    let mut found = Vec::new();
    let default_output = policy.tokens.default_max_output;
    for (index, limit) in policy.limits.iter().enumerate() {
        if let Measure::Tokens { amount, count: TokenCount::Total | TokenCount::Output } = limit.measure {
            if amount < default_output {
                found.push(format!(
                    "field `limits[{index}].tokens`: {amount} is below `tokens.default_max_output` \
                     ({default_output}): a request that names no max_tokens reserves its prompt plus \
                     {default_output}, so limit {:?} refuses every such request; lower \
                     `tokens.default_max_output` or raise the limit",
                    limit.name
                ));
            }
        }
    }
    let instances_written = written.pointer("/fallback/instances").is_some();
    if policy.failure_mode == FailureMode::Local && policy.fallback.instances == 1 && !instances_written {
        found.push(
            "`failure_mode` is local and `fallback.instances` is left at 1: when the companion or Redis \
             fails, every proxy admits the whole of every limit on its own, so N proxies admit N times the \
             limit. Set `fallback.instances` to the number of proxies (write 1 if there is only one)"
                .to_string(),
        );
    }
    let timeout = policy.companion.timeout;
    let longest_callout = timeout + policy.queue.max_wait;
    let orders: [(bool, &str, Duration, &str, Duration, &str); 3] = [
        (
            true,
            "fallback.breaker_cooldown",
            policy.fallback.breaker_cooldown,
            "companion.timeout",
            timeout,
            "an open breaker's probe may still be waiting when the cooldown ends",
        ),
        (
            policy.lease.enabled,
            "lease.ttl",
            policy.lease.ttl,
            "companion.timeout",
            timeout,
            "a lease can run out before the callout that renews it is answered",
        ),
        (
            policy.has_concurrency(),
            "slots.ttl",
            policy.slots.ttl,
            "companion.timeout + queue.max_wait",
            longest_callout,
            "a slot can expire before the callout that took it is answered",
        ),
    ];
    for (applies, shorter, short, longer, long, why) in orders {
        if applies && short <= long {
            found.push(format!(
                "timeouts in the wrong order: `{shorter}` ({}) is not longer than `{longer}` ({}): {why}",
                millis(short),
                millis(long)
            ));
        }
    }
    found
}

fn millis(duration: Duration) -> String {
    format!("{}ms", duration.as_millis())
}
