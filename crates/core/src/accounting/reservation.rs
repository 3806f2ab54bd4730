//! Two-phase token accounting: what a request reserves before it goes upstream, and the
//! correction once the reply shows what it really cost.
//!
//! Reserve `T_est = T_in + min(max_output, factor x running average output)`, where `T_in`
//! is the prompt counted in the proxy; settle by giving back `T_est - T_actual` (or taking
//! the excess). The reservation is all that protects a limit while many long completions
//! run at once, which is why it includes the completion estimate rather than the prompt
//! alone.

use crate::api::ReportedUsage;

/// Prompt and output tokens: what a request reserves (its estimate), or what it used
/// (`actual_usage`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenCounts {
    pub prompt: u64,
    pub output: u64,
}

impl TokenCounts {
    /// Saturating: `max_tokens: 1e20` is a client's to send, and must read as too large
    /// for any limit, not wrap round to a small reservation.
    pub fn total(self) -> u64 {
        self.prompt.saturating_add(self.output)
    }
}

/// The completion estimate: the output cap, or less when this tenant's completions for
/// the model are known to run shorter.
pub fn estimate_output(cap: u64, average: Option<OutputAverage>, factor: f64) -> u64 {
    match average {
        Some(avg) if avg.samples > 0 => cap.min((avg.mean * factor).ceil().max(1.0) as u64),
        _ => cap,
    }
}

/// What an upstream error (status >= 400) is charged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum UpstreamErrorCharge {
    /// Charge the prompt only: the provider generated nothing.
    #[default]
    PromptOnly,
    /// Keep the whole estimate.
    Estimate,
}

/// How a reply ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// The upstream answered with a success status and the reply was read to its end.
    Completed,
    /// The upstream answered with status >= 400.
    UpstreamError,
    /// The client went away or the stream broke before the end.
    Interrupted,
    /// The provider stopped the stream for its own rate limits (Bedrock's
    /// `throttlingException` event): the model generated nothing past what was sent.
    Throttled,
}

/// What the request really cost. Provider-reported figures win; then what the proxy
/// counted (the prompt, the streamed text); then the estimate.
pub fn actual_usage(
    estimate: TokenCounts,
    ending: Ending,
    reported: ReportedUsage,
    streamed_output: Option<u64>,
    on_error: UpstreamErrorCharge,
) -> TokenCounts {
    let prompt = reported.input.unwrap_or(estimate.prompt);
    let output = match ending {
        Ending::Completed => reported.output.or(streamed_output).unwrap_or(estimate.output),
        Ending::UpstreamError => match on_error {
            UpstreamErrorCharge::PromptOnly => reported.output.unwrap_or(0),
            UpstreamErrorCharge::Estimate => return estimate,
        },
        // What was generated before the end; a non-streamed reply never arrived. A stream
        // the provider throttled stopped generating where it stopped sending.
        Ending::Interrupted | Ending::Throttled => reported.output.or(streamed_output).unwrap_or(0),
    };
    TokenCounts { prompt, output }
}

/// What to give back (positive) or to take as well (negative) of what was `reserved`,
/// once `used` is known.
pub fn credit(reserved: u64, used: u64) -> i64 {
    i64::try_from(reserved).unwrap_or(i64::MAX).saturating_sub(i64::try_from(used).unwrap_or(i64::MAX))
}

/// The weight of the newest of `samples` samples in a running average: a plain mean over
/// the first `window`, then an exponential average over about that many.
pub fn sample_weight(samples: u32, window: u32) -> f64 {
    1.0 / f64::from(samples.clamp(1, window.max(1)))
}

/// A tenant's running average completion length for one model: the mean of the last
/// `WINDOW` completions, roughly (an exponential average once warmed up).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OutputAverage {
    pub mean: f64,
    pub samples: u32,
}

impl OutputAverage {
    const WINDOW: u32 = 20;

    pub fn first(output: u64) -> OutputAverage {
        OutputAverage { mean: output as f64, samples: 1 }
    }

    pub fn update(self, output: u64) -> OutputAverage {
        let samples = self.samples.saturating_add(1);
        OutputAverage { mean: self.mean + (output as f64 - self.mean) * sample_weight(samples, Self::WINDOW), samples }
    }

    pub fn to_bytes(self) -> [u8; 12] {
        let mut bytes = [0u8; 12];
        bytes[..8].copy_from_slice(&self.mean.to_le_bytes());
        bytes[8..].copy_from_slice(&self.samples.to_le_bytes());
        bytes
    }

    pub fn from_bytes(bytes: &[u8]) -> Option<OutputAverage> {
        let mean = f64::from_le_bytes(bytes.get(..8)?.try_into().ok()?);
        let samples = u32::from_le_bytes(bytes.get(8..12)?.try_into().ok()?);
        (mean.is_finite() && mean >= 0.0).then_some(OutputAverage { mean, samples })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EST: TokenCounts = TokenCounts { prompt: 100, output: 500 };

    fn reported(input: Option<u64>, output: Option<u64>) -> ReportedUsage {
        ReportedUsage { input, output, cached_input: None, reasoning: None }
    }

    #[test]
    fn the_estimate_uses_the_average_below_the_cap() {
        assert_eq!(estimate_output(4096, None, 1.5), 4096);
        assert_eq!(estimate_output(4096, Some(OutputAverage::first(200)), 1.5), 300);
        assert_eq!(estimate_output(250, Some(OutputAverage::first(200)), 1.5), 250);
        assert_eq!(estimate_output(100, Some(OutputAverage::first(0)), 1.5), 1);
    }

    #[test]
    fn actual_cost_per_ending() {
        use Ending::*;
        use UpstreamErrorCharge::*;
        let cases = [
            (Completed, reported(Some(120), Some(80)), None, PromptOnly, 200),
            (Completed, reported(None, None), Some(42), PromptOnly, 142),
            (Completed, reported(Some(90), None), Some(42), PromptOnly, 132),
            (Completed, reported(None, None), None, PromptOnly, 600),
            (UpstreamError, reported(None, None), None, PromptOnly, 100),
            (UpstreamError, reported(None, None), None, Estimate, 600),
            (Interrupted, reported(Some(110), None), Some(7), PromptOnly, 117),
            (Interrupted, reported(None, None), None, PromptOnly, 100),
        ];
        for (ending, usage, streamed, on_error, expected) in cases {
            assert_eq!(
                actual_usage(EST, ending, usage, streamed, on_error).total(),
                expected,
                "{ending:?} {usage:?} {streamed:?}"
            );
        }
    }

    #[test]
    fn an_upstream_error_charges_the_prompt_alone() {
        let usage =
            actual_usage(EST, Ending::UpstreamError, reported(None, None), None, UpstreamErrorCharge::PromptOnly);
        assert_eq!(usage, TokenCounts { prompt: 100, output: 0 });
    }

    #[test]
    fn credit_is_signed() {
        assert_eq!(credit(EST.total(), 200), 400);
        assert_eq!(credit(EST.total(), 600), 0);
        assert_eq!(credit(EST.total(), 1000), -400);
        assert_eq!(credit(0, u64::MAX), -i64::MAX);
    }

    #[test]
    fn the_average_follows_recent_completions_and_round_trips() {
        let mut avg = OutputAverage::first(100);
        for _ in 0..200 {
            avg = avg.update(500);
        }
        assert!((avg.mean - 500.0).abs() < 1.0, "{avg:?}");
        assert_eq!(OutputAverage::from_bytes(&avg.to_bytes()), Some(avg));
        assert_eq!(OutputAverage::from_bytes(&[1, 2, 3]), None);
        assert_eq!(
            OutputAverage::from_bytes(&f64::NAN.to_le_bytes().iter().chain(&[0; 4]).copied().collect::<Vec<_>>()),
            None
        );
    }
}
