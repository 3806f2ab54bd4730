//! Why the filter answers a request itself, in no provider's words: the replies say it
//! (`crate::replies`), each provider's module wraps it in its error envelope.

/// Why the filter answers a request itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// A limit is exhausted (429) and frees within the retry horizon: a short wait fixes
    /// it. OpenAI's `error.type` for it: `requests`, `tokens`, `input_tokens`, `cost`,
    /// `concurrency`...
    RateLimited(&'static str),
    /// The request asks more of a limit than its whole capacity, so no wait ever admits
    /// it (429, with no `Retry-After`): only a smaller request can. OpenAI's `error.type`,
    /// as for `RateLimited`.
    NeverFits(&'static str),
    /// A budget spent until its period ends, or any limit that frees only past the retry
    /// horizon (`refusals.retry_horizon`): a short wait cannot fix it. `status` is 429
    /// (as OpenAI sends its `insufficient_quota`) or 403 (`refusals.spent_status`, Azure
    /// API Management's convention for a spent quota).
    QuotaSpent { status: u32 },
    /// The body is larger than the filter reads (413).
    TooLarge,
    /// The limiter cannot decide and the config says deny (503).
    Unavailable,
    /// No API key (401).
    Unidentified,
    /// A budget applies but the model has no price (403).
    NotPriced,
    /// The caller (its key, its team, or its end user) is suspended by its plan, set at
    /// runtime by an operator (403, not retryable): no wait lifts it, only the operator.
    Suspended,
    /// A request the filter will not read one way while the upstream may read it another
    /// (400): conflicting credentials, a body it cannot parse, a field given twice, a path
    /// it refuses. OpenAI's `error.code` for it.
    Unreadable(&'static str),
}

impl Refusal {
    pub fn status(self) -> u32 {
        match self {
            Refusal::RateLimited(_) | Refusal::NeverFits(_) => 429,
            Refusal::QuotaSpent { status } => status,
            Refusal::TooLarge => 413,
            Refusal::Unavailable => 503,
            Refusal::Unidentified => 401,
            Refusal::NotPriced | Refusal::Suspended => 403,
            Refusal::Unreadable(_) => 400,
        }
    }

    /// Whether the refusal is one a client's automatic retries cannot get past, though
    /// its status may be one they retry (429; some retry a 403 too): it carries `x-should-retry: false`, which the
    /// official OpenAI and Anthropic SDKs obey before they look at the status.
    pub fn lasts(self) -> bool {
        matches!(self, Refusal::NeverFits(_) | Refusal::QuotaSpent { .. } | Refusal::Suspended)
    }
}
