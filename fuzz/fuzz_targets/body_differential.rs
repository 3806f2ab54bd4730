//! Any bytes as a chat body, read by the filter and by serde_json (what Python's `json`
//! and Go's `encoding/json` also accept, less their extensions): where the filter reads
//! a body, serde_json reads the same body with the same fields, so nothing is charged
//! below what the upstream will do; where they differ, the filter must have refused it.
#![no_main]
use libfuzzer_sys::fuzz_target;
use llm_ratelimit_core::api::Api;
use llm_ratelimit_core::readers::request::LlmRequest;
use serde_json::Value;

fn count(value: &Value) -> Option<u64> {
    value.as_u64().or_else(|| value.as_f64().filter(|f| *f >= 0.0).map(|f| f as u64))
}

fuzz_target!(|data: &[u8]| {
    let Ok(parsed) = LlmRequest::parse(Api::ChatCompletions, data) else { return };
    let request = parsed.request;
    let text = data.strip_prefix("\u{feff}".as_bytes()).unwrap_or(data);
    let Ok(upstream) = serde_json::from_slice::<Value>(text) else {
        panic!("the filter read a body serde_json refuses: {:?}", String::from_utf8_lossy(data));
    };
    assert_eq!(request.model.as_deref(), upstream.get("model").and_then(Value::as_str));
    let cap = upstream.get("max_completion_tokens").and_then(count).or_else(|| upstream.get("max_tokens").and_then(count));
    assert_eq!(request.max_output, cap);
    let n = upstream.get("n").and_then(count).unwrap_or(1).max(1);
    assert_eq!(request.choices, n, "never fewer choices than the upstream generates");
    assert_eq!(request.stream, upstream.get("stream").and_then(Value::as_bool).unwrap_or(false));
});
