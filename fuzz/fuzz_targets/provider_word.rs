//! Any bytes as a provider's reply: cut at NUL bytes into the values of the rate-limit and
//! retry headers each provider sends (in `provider_word`'s order) and, after them, a
//! throttling error's body: what the provider said, bounded, never a panic.
#![no_main]
use libfuzzer_sys::fuzz_target;
use llm_ratelimit_core::effects::provider_word::{read_headers, retry_info_ms, MAX_WAIT_MS};

const NAMES: [&str; 15] = [
    "x-ratelimit-remaining-requests",
    "x-ratelimit-reset-requests",
    "x-ratelimit-remaining-tokens",
    "x-ratelimit-reset-tokens",
    "anthropic-ratelimit-requests-remaining",
    "anthropic-ratelimit-requests-reset",
    "anthropic-ratelimit-tokens-remaining",
    "anthropic-ratelimit-tokens-reset",
    "anthropic-ratelimit-input-tokens-remaining",
    "anthropic-ratelimit-input-tokens-reset",
    "anthropic-ratelimit-output-tokens-remaining",
    "anthropic-ratelimit-output-tokens-reset",
    "retry-after",
    "retry-after-ms",
    "x-amzn-errortype",
];

fuzz_target!(|data: &[u8]| {
    let Some((&status, rest)) = data.split_first() else { return };
    let mut parts = rest.split(|&b| b == 0);
    let values: Vec<String> = parts.by_ref().take(NAMES.len()).map(|v| String::from_utf8_lossy(v).into_owned()).collect();
    let body: Vec<u8> = parts.flatten().copied().collect();
    let mut header = |name: &str| NAMES.iter().position(|n| *n == name).and_then(|i| values.get(i).cloned());
    let word = read_headers(u32::from(status) + 300, &mut header, 1_796_139_420_000);
    assert!(word.left.iter().flatten().all(|l| l.reset_after_ms <= MAX_WAIT_MS));
    assert!(word.out_for_ms(1000).is_none_or(|ms| ms <= MAX_WAIT_MS));
    assert!(retry_info_ms(&body).is_none_or(|ms| ms <= MAX_WAIT_MS));
});
