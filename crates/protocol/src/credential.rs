//! What a credential between the filter and the companion must be, checked by both: the
//! companion at start, the filter at load. A short or placeholder secret is one an attacker
//! guesses or finds in a public example, so neither side accepts one.

/// The fewest bytes a credential may have.
pub const MIN_CREDENTIAL_BYTES: usize = 16;

/// Words that mark a value copied from an example rather than generated (compared without
/// case, anywhere in the value).
const PLACEHOLDERS: [&str; 7] =
    ["change-me", "changeme", "change_me", "replace-me", "replaceme", "placeholder", "example"];

/// Why `value` cannot be a credential, or `None`. The reason never quotes the value.
pub fn weakness(value: &str) -> Option<String> {
    if value.is_empty() {
        return Some("must not be empty".into());
    }
    let lower = value.to_ascii_lowercase();
    if let Some(word) = PLACEHOLDERS.iter().find(|word| lower.contains(*word)) {
        return Some(format!("is a placeholder (it contains {word:?}): generate one, e.g. `openssl rand -hex 32`"));
    }
    if value.len() < MIN_CREDENTIAL_BYTES {
        return Some(format!(
            "is {} bytes long; at least {MIN_CREDENTIAL_BYTES} are required (e.g. `openssl rand -hex 32`)",
            value.len()
        ));
    }
    if value.chars().any(char::is_control) {
        return Some("contains a control character (a header value cannot carry it)".into());
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_short_placeholder_and_empty_credentials() {
        assert!(weakness("").is_some());
        assert!(weakness("t").unwrap().contains("1 bytes"));
        assert!(weakness("fifteen-bytes!!").unwrap().contains("15 bytes"));
        assert!(weakness("change-me").unwrap().contains("placeholder"));
        assert!(weakness("CHANGE-ME-to-a-long-random-value").unwrap().contains("placeholder"));
        assert!(weakness("sixteen-bytes-ok\n").unwrap().contains("control"));
        assert_eq!(weakness("sixteen-bytes-ok"), None);
        assert_eq!(weakness("3f1c0a7e9b2d4c6f8a1e3b5d7f9c2a4e"), None);
    }

    #[test]
    fn the_reason_never_quotes_the_value() {
        // (A value that is only a placeholder word is named as the word: it is no secret.)
        for value in ["abc", "my-change-me-secret", "x-placeholder-value-long"] {
            assert!(!weakness(value).unwrap().contains(value), "{value}");
        }
    }
}
