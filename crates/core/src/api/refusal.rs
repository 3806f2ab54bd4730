//! Why the filter answers a request itself, in no provider's words: the replies say it
//! (`crate::replies`), each provider's module wraps it in its error envelope.

/// Why the filter answers a request itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// A limit is exhausted (429). OpenAI's `error.type` for it: `requests`, `tokens`,
    /// `input_tokens`, `cost`, `concurrency`...
    RateLimited(&'static str),
    /// The body is larger than the filter reads (413).
    TooLarge,
    /// The limiter cannot decide and the config says deny (503).
    Unavailable,
    /// No API key (401).
    Unidentified,
    /// A budget applies but the model has no price (403).
    NotPriced,
    /// A request the filter will not read one way while the upstream may read it another
    /// (400): conflicting credentials, a body it cannot parse, a field given twice, a path
    /// it refuses. OpenAI's `error.code` for it.
    Unreadable(&'static str),
}

impl Refusal {
    pub fn status(self) -> u32 {
        match self {
            Refusal::RateLimited(_) => 429,
            Refusal::TooLarge => 413,
            Refusal::Unavailable => 503,
            Refusal::Unidentified => 401,
            Refusal::NotPriced => 403,
            Refusal::Unreadable(_) => 400,
        }
    }
}
