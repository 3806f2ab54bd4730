//! What the proxy learns from settled replies, per model rule: how the provider's count of
//! a prompt relates to the proxy's own, and how long the model's completions run.
//! Reservations use both: a prompt is reserved at the learned factor (never below the
//! rule's configured `factor`), and a tenant with no history of its own for a model
//! reserves the model's learned completion length instead of the output cap.
//!
//! The figures and how a lesson moves them, pure; where they are kept (shared data, the
//! fleet's exchange) is `crate::effects::calibration_store`.

use crate::accounting::reservation::sample_weight;
use crate::protocol::RunningFigure;

pub use crate::protocol::CALIBRATION_WINDOW as WINDOW;
/// The largest learned prompt factor (unless the rule's own `factor` is larger): one
/// tenant's odd requests (images the provider bills far above the proxy's figure, say)
/// cannot make every tenant's reservations grow without end.
pub const MAX_FACTOR: f64 = 4.0;
/// How many deviations above the mean a learned figure is taken at: the margin that keeps
/// the spread of per-request ratios from showing up as overshoot.
pub const MARGIN: f64 = 2.0;
/// How many completions of a model this proxy must have seen before their length stands
/// in for a tenant's own history.
pub const PRIOR_SAMPLES: u32 = 3;

/// A running mean of samples and of how far they stray from it (mean absolute deviation).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Running {
    pub mean: f64,
    pub deviation: f64,
    pub samples: u32,
}

impl Running {
    /// `previous` with `sample` taken in.
    pub fn observe(previous: Option<Running>, sample: f64) -> Running {
        Running::observe_in(previous, sample, WINDOW)
    }

    /// `previous` with `sample` taken in, over a window of `window` samples.
    fn observe_in(previous: Option<Running>, sample: f64, window: u32) -> Running {
        let Some(previous) = previous else { return Running { mean: sample, deviation: 0.0, samples: 1 } };
        let samples = previous.samples.saturating_add(1);
        let weight = sample_weight(samples, window);
        let error = sample - previous.mean;
        Running {
            mean: previous.mean + error * weight,
            deviation: previous.deviation + (error.abs() - previous.deviation) * weight,
            samples,
        }
    }

    /// The figure reservations use: the mean plus `MARGIN` deviations.
    pub fn upper(&self) -> f64 {
        self.mean + MARGIN * self.deviation
    }

    const BYTES: usize = 20;

    fn encode(running: Option<Running>, out: &mut Vec<u8>) {
        let Running { mean, deviation, samples } = running.unwrap_or(Running { mean: 0.0, deviation: 0.0, samples: 0 });
        out.extend_from_slice(&mean.to_le_bytes());
        out.extend_from_slice(&deviation.to_le_bytes());
        out.extend_from_slice(&samples.to_le_bytes());
    }

    fn decode(bytes: &[u8]) -> Option<Running> {
        let mean = f64::from_le_bytes(bytes.get(..8)?.try_into().ok()?);
        let deviation = f64::from_le_bytes(bytes.get(8..16)?.try_into().ok()?);
        let samples = u32::from_le_bytes(bytes.get(16..20)?.try_into().ok()?);
        Running::sane(mean, deviation, samples).then_some(Running { mean, deviation, samples })
    }
}

/// What one settled reply teaches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Lesson {
    /// The prompt as the proxy counted it (before any factor) and as the provider reported it.
    pub prompt: Option<(u64, u64)>,
    /// The completion's length.
    pub output: Option<u64>,
}

/// What this proxy has learned about one rule's models.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Calibration {
    /// The provider's prompt tokens per token the proxy counted.
    pub prompt_ratio: Option<Running>,
    /// Completion lengths, in tokens.
    pub output: Option<Running>,
}

impl Calibration {
    /// The factor a prompt counted in the proxy is reserved at: the learned ratio (its
    /// upper figure), never below `floor` (the rule's configured factor) and never above
    /// `MAX_FACTOR` (or `floor`, if that is larger). `floor` until anything is learned.
    pub fn prompt_factor(&self, floor: f64) -> f64 {
        self.prompt_ratio.map_or(floor, |ratio| ratio.upper().clamp(floor, floor.max(MAX_FACTOR)))
    }

    /// The completion length that stands in for a tenant's own history, once this proxy
    /// has seen `PRIOR_SAMPLES` of the model's completions.
    pub fn output_prior(&self) -> Option<f64> {
        self.output.filter(|o| o.samples >= PRIOR_SAMPLES).map(|o| o.upper())
    }

    /// This calibration with `lesson` taken in. A prompt the proxy counted as nothing
    /// teaches no ratio.
    pub fn learn(self, lesson: Lesson) -> Calibration {
        let ratio = lesson
            .prompt
            .filter(|&(counted, _)| counted > 0)
            .map(|(counted, reported)| Running::observe(self.prompt_ratio, reported as f64 / counted as f64));
        Calibration {
            prompt_ratio: ratio.or(self.prompt_ratio),
            output: lesson.output.map(|o| Running::observe(self.output, o as f64)).or(self.output),
        }
    }

    /// Each figure from `fleet` where it rests on at least as many samples as this one's.
    pub fn or_fleet(self, fleet: Calibration) -> Calibration {
        let pick = |own: Option<Running>, fleet: Option<Running>| match (own, fleet) {
            (Some(own), Some(theirs)) if own.samples > theirs.samples => Some(own),
            (own, None) => own,
            (_, theirs) => theirs,
        };
        Calibration {
            prompt_ratio: pick(self.prompt_ratio, fleet.prompt_ratio),
            output: pick(self.output, fleet.output),
        }
    }

    pub fn to_bytes(self) -> Vec<u8> {
        let mut out = Vec::with_capacity(2 * Running::BYTES);
        Running::encode(self.prompt_ratio, &mut out);
        Running::encode(self.output, &mut out);
        out
    }

    pub fn from_bytes(bytes: &[u8]) -> Calibration {
        Calibration {
            prompt_ratio: bytes.get(..Running::BYTES).and_then(Running::decode),
            output: bytes.get(Running::BYTES..).and_then(Running::decode),
        }
    }
}

impl Running {
    /// A figure from the fleet, if it is one a proxy could have learned.
    pub(crate) fn from_figure(figure: RunningFigure) -> Option<Running> {
        let RunningFigure { mean, deviation, samples } = figure;
        Running::sane(mean, deviation, samples).then_some(Running { mean, deviation, samples })
    }

    fn sane(mean: f64, deviation: f64, samples: u32) -> bool {
        let sane = |x: f64| x.is_finite() && x >= 0.0;
        samples > 0 && sane(mean) && sane(deviation)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lesson(counted: u64, reported: u64) -> Lesson {
        Lesson { prompt: Some((counted, reported)), output: None }
    }

    #[cfg_attr(not(target_arch = "wasm32"), test)]
    #[cfg_attr(target_arch = "wasm32", wasm_bindgen_test::wasm_bindgen_test)]
    fn the_factor_starts_at_the_floor_takes_the_first_ratio_and_follows_recent_replies() {
        let cold = Calibration::default();
        assert_eq!(cold.prompt_factor(1.1), 1.1, "nothing learned: the configured factor");
        // 16 counted, 37 reported: the first reply sets the factor.
        let first = cold.learn(lesson(16, 37));
        assert_eq!(first.prompt_factor(1.0), 37.0 / 16.0);
        assert_eq!((16.0 * first.prompt_factor(1.0)).ceil(), 37.0, "reserves what the provider counts");
        // The provider changes its count: after WINDOW replies the old ratio weighs
        // (1 - 1/20)^n, and the spread it caused fades with it.
        let mut calibration = first;
        for _ in 0..100 {
            calibration = calibration.learn(lesson(100, 150));
        }
        let ratio = calibration.prompt_ratio.expect("learned");
        assert!((ratio.mean - 1.5).abs() < 0.01 && ratio.deviation < 0.01, "{ratio:?}");
        assert!((calibration.prompt_factor(1.0) - 1.5).abs() < 0.03);
    }

    #[test]
    fn running_figures_follow_the_case_table_the_lua_script_is_tested_with() {
        // tests/cases/calibration.json is read by tests/lua/test_lua_calibration.py too.
        let table: serde_json::Value =
            serde_json::from_str(include_str!("../../../../tests/cases/calibration.json")).expect("calibration.json");
        let cases = table["cases"].as_array().expect("cases");
        assert!(!cases.is_empty());
        for case in cases {
            let window = case["window"].as_u64().expect("window") as u32;
            let running = case["samples"]
                .as_array()
                .expect("samples")
                .iter()
                .fold(None, |running, x| Some(Running::observe_in(running, x.as_f64().expect("sample"), window)))
                .expect("samples given");
            assert_eq!(u64::from(running.samples), case["count"].as_u64().expect("count"), "{case}");
            assert!((running.mean - case["mean"].as_f64().expect("mean")).abs() < 1e-9, "{case} {running:?}");
            assert!((running.deviation - case["deviation"].as_f64().expect("dev")).abs() < 1e-9, "{case} {running:?}");
        }
    }

    #[test]
    fn the_fleets_figures_replace_the_proxys_unless_the_proxy_knows_more() {
        let running = |mean: f64, samples| Some(Running { mean, deviation: 0.0, samples });
        let own = Calibration { prompt_ratio: running(2.0, 5), output: running(40.0, 3) };
        let fleet = Calibration { prompt_ratio: running(2.5, 50), output: running(90.0, 2) };
        let taken = own.or_fleet(fleet);
        assert_eq!(taken.prompt_ratio, fleet.prompt_ratio, "the fleet saw more replies");
        assert_eq!(taken.output, own.output, "lessons the fleet has not had yet stay");
        assert_eq!(own.or_fleet(Calibration::default()), own);
        assert_eq!(Calibration::default().or_fleet(fleet), fleet);
    }

    #[test]
    fn the_factor_holds_a_margin_for_the_spread_of_ratios() {
        let mut calibration = Calibration::default();
        for reported in [110, 130, 110, 130, 110, 130] {
            calibration = calibration.learn(lesson(100, reported));
        }
        let ratio = calibration.prompt_ratio.expect("learned");
        assert!(ratio.mean > 1.15 && ratio.mean < 1.25, "{ratio:?}");
        // Mean plus two mean deviations: at least the larger of the two ratios seen.
        assert!(calibration.prompt_factor(1.0) >= 1.3, "{}", calibration.prompt_factor(1.0));
    }

    #[test]
    fn the_factor_is_bounded_by_the_configured_floor_and_the_maximum() {
        let low = Calibration::default().learn(lesson(100, 50));
        assert_eq!(low.prompt_factor(1.0), 1.0, "never below the configured factor");
        assert_eq!(low.prompt_factor(1.2), 1.2);
        let high = Calibration::default().learn(lesson(10, 1000));
        assert_eq!(high.prompt_factor(1.0), MAX_FACTOR);
        assert_eq!(high.prompt_factor(6.0), 6.0, "a configured factor above the maximum stands");
        assert_eq!(Calibration::default().learn(lesson(0, 40)), Calibration::default(), "nothing counted: no ratio");
    }

    #[test]
    fn the_output_prior_needs_a_few_completions_and_round_trips() {
        let mut calibration = Calibration::default();
        for output in [40, 40] {
            calibration = calibration.learn(Lesson { prompt: None, output: Some(output) });
        }
        assert_eq!(calibration.output_prior(), None, "two completions are not enough");
        calibration = calibration.learn(Lesson { prompt: Some((16, 37)), output: Some(40) });
        assert_eq!(calibration.output_prior(), Some(40.0));
        assert_eq!(Calibration::from_bytes(&calibration.to_bytes()), calibration);
        assert_eq!(Calibration::from_bytes(&[1, 2, 3]), Calibration::default());
        let mut nan = calibration.to_bytes();
        nan[..8].copy_from_slice(&f64::NAN.to_le_bytes());
        assert_eq!(Calibration::from_bytes(&nan).prompt_ratio, None);
        assert_eq!(Calibration::from_bytes(&nan).output, calibration.output);
    }
}
