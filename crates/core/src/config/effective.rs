//! The config as the filter runs it: what was written, with every default filled in
//! (`llm-ratelimit check-config --print-effective`). The defaults are the shape's own
//! (`shape.rs`), so what is printed cannot drift from what the filter does.

use super::error::{invalid, ConfigError};
use super::shape::Document;
use super::{Policy, TokenCount};
use serde_json::Value;

/// `bytes` with every field present: the written values, the default of each field not
/// written, secrets as `REDACTED` (a limit shows only the fields of its kind). A config the filter would refuse is refused here with
/// the same error. `companion.authority` unset is the upstream; the one default that
/// depends on the host (`hold_request_headers`) is left to the caller, which knows it.
pub fn effective(bytes: &[u8]) -> Result<(Policy, Value), ConfigError> {
    let written = Document::parse(bytes)?;
    let policy = Policy::from_json(bytes)?;
    let mut value = serde_json::to_value(&written).map_err(|e| invalid("(top level)", e.to_string()))?;
    let Some(top) = value.as_object_mut() else { return Err(invalid("(top level)", "not an object")) };
    // The local store has no companion.
    if let (Some(companion), Some(Value::Object(shown))) = (&written.companion, top.get_mut("companion")) {
        let authority = companion.authority.clone().unwrap_or_else(|| companion.upstream.clone());
        shown.insert("authority".into(), Value::String(authority));
    }
    // What only the Redis store has, filled as the filter resolves it; the local store
    // has none of it (a written one is refused).
    if policy.store == super::Store::Redis {
        if let Some(Value::Object(tokens)) = top.get_mut("tokens") {
            tokens.insert("share_calibration".into(), Value::Bool(policy.tokens.share_calibration));
        }
        let defaults = [
            ("failure_mode", serde_json::to_value(super::FailureMode::default())),
            ("fallback", serde_json::to_value(super::shape::Fallback::default())),
        ];
        for (field, default) in defaults {
            if top.get(field).is_none_or(Value::is_null) {
                top.insert(field.into(), default.map_err(|e| invalid(field, e.to_string()))?);
            }
        }
    } else {
        top.retain(|_, field| !field.is_null());
    }
    // A limit shows what it counts: its one kind and, for tokens, which of them.
    for (limit, compiled) in
        top.get_mut("limits").and_then(Value::as_array_mut).into_iter().flatten().zip(&policy.limits)
    {
        let Some(fields) = limit.as_object_mut() else { continue };
        // A pool's fair shares as the script is sent them.
        if let (Some(fair), Some(Value::Object(shown))) = (&compiled.fair_share, fields.get_mut("fair_share")) {
            shown.insert("weights".into(), serde_json::json!(fair.weights));
            shown.insert("default_weight".into(), serde_json::json!(fair.default_weight));
            shown.insert("max_tenants".into(), serde_json::json!(fair.max_tenants));
            shown.insert("idle".into(), serde_json::json!(super::shape::ConfigDuration(fair.idle)));
            let between = match &fair.between {
                super::Per::Header { name, default: Some(default) } => {
                    serde_json::json!({"header": name, "default": default})
                }
                super::Per::Header { name, default: None } => serde_json::json!({"header": name}),
                super::Per::Tenant | super::Per::All | super::Per::EndUser { .. } => Value::String("tenant".into()),
            };
            shown.insert("between".into(), between);
        }
        fields.retain(|_, field| !field.is_null());
        if fields.contains_key("tokens") {
            fields.entry("count").or_insert_with(|| serde_json::json!(TokenCount::default()));
        }
        // Counted per tenant and enforced unless written otherwise.
        fields.entry("per").or_insert_with(|| Value::String("tenant".into()));
        fields.entry("mode").or_insert_with(|| Value::String("enforce".into()));
    }
    Ok((policy, value))
}
