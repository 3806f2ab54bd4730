//! The request path as the filter reads it, written once: routing and bypass matching go
//! through here, so no two readers of a path can disagree on what it is.

/// The path without its query string or fragment: what `bypass.paths` is matched on.
pub fn without_query(path: &str) -> &str {
    path.split(['?', '#']).next().unwrap_or("")
}

/// The path an API is recognised in: without the query string or fragment, and without
/// trailing slashes (`/v1/messages/` is `/v1/messages`).
pub fn normalised(path: &str) -> &str {
    without_query(path).trim_end_matches('/')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_query_fragment_and_trailing_slashes_go() {
        assert_eq!(normalised("/v1/messages/?beta=true"), "/v1/messages");
        assert_eq!(normalised("/v1/chat/completions#x"), "/v1/chat/completions");
        assert_eq!(normalised("//"), "");
        assert_eq!(without_query("/v1/models/?x"), "/v1/models/");
        assert_eq!(without_query(""), "");
    }
}
