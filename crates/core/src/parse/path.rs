//! The request path as the filter reads it, written once: routing and bypass matching go
//! through here, so no two readers of a path can disagree on what it is, and a path
//! spelled another way (`/v1/models/../chat/completions`, `//v1/chat/completions`,
//! `/v1/%63hat/completions`) is read as the upstream that resolves it would read it.

/// The path without its query string or fragment.
pub fn without_query(path: &str) -> &str {
    path.split(['?', '#']).next().unwrap_or("")
}

/// The path routing and `bypass.paths` read: without the query string or fragment;
/// unreserved characters percent-decoded (RFC 3986 6.2.2.2: `%63` is `c`; `%2F` and `%3A`
/// stay encoded, as they are data in a segment); repeated slashes merged; `.` and `..`
/// segments resolved (RFC 3986 5.2.4, `..` never above the root); trailing slashes gone
/// (`/v1/messages/` is `/v1/messages`).
pub fn normalised(path: &str) -> String {
    let path = without_query(path);
    // The usual path is already in this form: one scan instead of a rebuild.
    if is_normal(path) {
        return path.to_string();
    }
    let decoded = decode_unreserved(path);
    let mut segments: Vec<&str> = Vec::new();
    for segment in decoded.split('/') {
        match segment {
            "" | "." => {}
            ".." => {
                segments.pop();
            }
            _ => segments.push(segment),
        }
    }
    let mut out = String::with_capacity(decoded.len());
    for segment in segments {
        out.push('/');
        out.push_str(segment);
    }
    out
}

/// Whether `path` (without its query) is what `normalised` makes of it: nothing encoded,
/// each segment after a leading `/` neither empty, `.` nor `..`.
fn is_normal(path: &str) -> bool {
    let mut segments = path.split('/');
    segments.next() == Some("") && !path.contains('%') && segments.all(|s| !matches!(s, "" | "." | ".."))
}

fn decode_unreserved(path: &str) -> String {
    let mut out = String::with_capacity(path.len());
    let mut rest = path;
    while let Some(at) = rest.find('%') {
        out.push_str(rest.get(..at).unwrap_or(""));
        let hex = rest.get(at + 1..at + 3).and_then(|h| u8::from_str_radix(h, 16).ok());
        match hex.filter(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')) {
            Some(byte) => {
                out.push(char::from(byte));
                rest = rest.get(at + 3..).unwrap_or("");
            }
            None => {
                out.push('%');
                rest = rest.get(at + 1..).unwrap_or("");
            }
        }
    }
    out.push_str(rest);
    out
}

/// APIs that spend tokens the filter cannot follow from one request: the Batch APIs
/// (OpenAI's and Azure's `/batches`, Anthropic's `/messages/batches`, Gemini's
/// `:batchGenerateContent`, Bedrock's `/model-invocation-job`) and OpenAI's Realtime
/// (a WebSocket session, and its `/realtime/…` sessions). `path` is normalised.
pub fn is_batch_or_realtime(path: &str) -> bool {
    path.split('/').any(|segment| {
        matches!(segment, "batches" | "realtime" | "model-invocation-job" | "model-invocation-jobs")
            || segment.ends_with(":batchGenerateContent")
            || segment.ends_with("%3AbatchGenerateContent")
            || segment.ends_with("%3abatchGenerateContent")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_path_is_read_as_the_upstream_resolves_it() {
        let cases = [
            ("/v1/messages/?beta=true", "/v1/messages"),
            ("/v1/chat/completions#x", "/v1/chat/completions"),
            ("//", ""),
            ("", ""),
            ("/v1/models/../chat/completions", "/v1/chat/completions"),
            ("/v1/models/%2e%2E/chat/completions", "/v1/chat/completions"),
            ("/v1/./chat//completions/", "/v1/chat/completions"),
            ("//v1///chat/completions", "/v1/chat/completions"),
            ("/../../v1/chat/completions", "/v1/chat/completions"),
            ("/v1/%63hat/completions", "/v1/chat/completions"),
            // Reserved characters are data in a segment: they stay encoded.
            ("/v1/models/a%2Fb", "/v1/models/a%2Fb"),
            ("/v1beta/models/gemini%3AgenerateContent", "/v1beta/models/gemini%3AgenerateContent"),
            ("/bad%zz/%", "/bad%zz/%"),
            ("/v1/models?x=/../y", "/v1/models"),
        ];
        for (raw, expected) in cases {
            assert_eq!(normalised(raw), expected, "{raw}");
            assert_eq!(normalised(&normalised(raw)), expected, "{raw}: normalising twice changes nothing");
        }
    }

    #[test]
    fn batch_and_realtime_paths_are_known() {
        for path in [
            "/v1/batches",
            "/v1/batches/batch_1/cancel",
            "/openai/batches",
            "/v1/messages/batches",
            "/v1/realtime",
            "/v1/realtime/sessions",
            "/v1beta/models/gemini-2.0-flash:batchGenerateContent",
            "/model-invocation-job",
        ] {
            assert!(is_batch_or_realtime(path), "{path}");
        }
        for path in ["/v1/chat/completions", "/v1/messages", "/v1/models", "/v1beta/models/g:generateContent"] {
            assert!(!is_batch_or_realtime(path), "{path}");
        }
    }
}
