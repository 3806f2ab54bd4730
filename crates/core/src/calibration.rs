//! What the proxy learns from settled replies, per model rule: how the provider's count of
//! a prompt relates to the proxy's own, and how long the model's completions run.
//! Reservations use both: a prompt is reserved at the learned factor (never below the
//! rule's configured `factor`), and a tenant with no history of its own for a model
//! reserves the model's learned completion length instead of the output cap.
//!
//! One value per rule (the operator's, the built-in families, one catch-all for every
//! other model) in shared data, so every worker of a proxy learns from every other's
//! replies and the memory is bounded by the config, whatever model names clients send.
//! Each value is tagged with its rule's pattern and encoding, so after a config change
//! that moved the rules a value that was another rule's reads as absent.
//!
//! Across proxies (`tokens.share_calibration`): each worker hands its new samples to the
//! companion about once a second (every 30 s when it learned nothing, and on its first
//! tick) and takes back the figures all proxies taught, per rule fingerprint, which
//! replace the proxy's own: a proxy that starts later reserves at what the fleet learned
//! from its first request. Samples of an exchange that fails are lost to the fleet only
//! (the proxy learned them already).

use crate::config::{ModelPolicy, Policy};
use crate::host::{shared_read, shared_update, Host};
use crate::protocol::{
    keys, CalibrationExchange, CalibrationReply, RuleSamples, RunningFigure, MAX_SAMPLES_PER_EXCHANGE,
};
use crate::reservation::sample_weight;
use crate::series;
use crate::tables::fnv1a;

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

/// Tags a rule's value, so another rule's (after the rules moved) reads as absent.
fn rule_tag(rule: &ModelPolicy) -> [u8; 8] {
    fingerprint(rule).to_le_bytes()
}

/// A rule's identity across proxies and configs: its model pattern and encoding.
fn fingerprint(rule: &ModelPolicy) -> u64 {
    fnv1a(&[&rule.rule.pattern, rule.rule.encoding.name()])
}

fn fingerprint_hex(rule: &ModelPolicy) -> String {
    format!("{:016x}", fingerprint(rule))
}

impl Running {
    /// A figure from the fleet, if it is one a proxy could have learned.
    fn from_figure(figure: RunningFigure) -> Option<Running> {
        let RunningFigure { mean, deviation, samples } = figure;
        Running::sane(mean, deviation, samples).then_some(Running { mean, deviation, samples })
    }

    fn sane(mean: f64, deviation: f64, samples: u32) -> bool {
        let sane = |x: f64| x.is_finite() && x >= 0.0;
        samples > 0 && sane(mean) && sane(deviation)
    }
}

fn key(config: &Policy, rule: usize) -> String {
    keys::calibration_key(&config.domain, u32::try_from(rule).unwrap_or(u32::MAX))
}

fn own<'a>(tag: &[u8; 8], stored: Option<&'a [u8]>) -> Option<&'a [u8]> {
    stored?.split_at_checked(tag.len()).filter(|(t, _)| t == tag).map(|(_, payload)| payload)
}

/// What this proxy has learned about the models of rule `rule` (nothing when calibration
/// is off).
pub(crate) fn read(host: &mut impl Host, config: &Policy, rule: usize) -> Calibration {
    if !config.tokens.calibrate {
        return Calibration::default();
    }
    let tag = rule_tag(config.tokens.rule(rule));
    let stored = shared_read(host, &key(config, rule));
    own(&tag, stored.as_deref()).map(Calibration::from_bytes).unwrap_or_default()
}

/// Rewrites rule `rule`'s calibration, shared by every worker, as `change` makes it from
/// the stored one, and shows the result in the rule's gauges.
fn rewrite(
    host: &mut impl Host,
    config: &Policy,
    rule: usize,
    change: impl Fn(Calibration) -> Calibration,
) -> Option<Calibration> {
    let policy = config.tokens.rule(rule);
    let tag = rule_tag(policy);
    let learned = shared_update(host, &key(config, rule), |stored| {
        let next = change(own(&tag, stored).map(Calibration::from_bytes).unwrap_or_default());
        let mut value = tag.to_vec();
        value.extend_from_slice(&next.to_bytes());
        (Some(value), next)
    })?;
    show(host, policy, learned);
    Some(learned)
}

/// Takes `lessons` (in the order they were learned) into rule `rule`'s calibration.
fn learn(host: &mut impl Host, config: &Policy, rule: usize, lessons: &[Lesson]) -> Option<Calibration> {
    rewrite(host, config, rule, |stored| lessons.iter().fold(stored, |calibration, lesson| calibration.learn(*lesson)))
}

/// Lessons waiting for the next tick, at most: a burst beyond teaches nothing new.
const MAX_PENDING_LESSONS: usize = 256;

/// One VM's side of the shared calibrations, so that they cost a request no host call of
/// its own: lessons are gathered and taken in together on the worker's tick (one
/// compare-and-swap and one pair of gauges per rule that learned something), and a rule's
/// value is read from shared data at most once a tick. What another worker learned shows
/// here within a tick or two.
#[derive(Debug, Default)]
pub struct LocalCalibrations {
    pending: Vec<(usize, Lesson)>,
    /// Each rule's value as last read or written, and when (bounded by the config's rules).
    known: std::collections::HashMap<usize, (Calibration, u64)>,
    /// Samples for the next exchange with the other proxies, by rule (bounded by the
    /// config's rules and `MAX_SAMPLES_PER_EXCHANGE`).
    outbox: std::collections::BTreeMap<usize, RuleSamples>,
    /// When the last exchange was sent; `None` before the first.
    last_exchange_ms: Option<u64>,
    /// The token of the exchange out, if one is.
    exchanging: Option<u32>,
}

/// How often a worker that learned something exchanges it, and how often one that did not
/// asks what the others learned.
pub const EXCHANGE_MS: u64 = 1_000;
pub const IDLE_EXCHANGE_MS: u64 = 30_000;

impl LocalCalibrations {
    /// What this proxy has learned about rule `rule` (nothing when calibration is off).
    pub fn get(&mut self, host: &mut impl Host, config: &Policy, rule: usize, now_ms: u64) -> Calibration {
        if !config.tokens.calibrate {
            return Calibration::default();
        }
        let fresh_ms = crate::host::TICK.as_millis() as u64;
        match self.known.get(&rule) {
            Some(&(calibration, read_ms)) if now_ms.saturating_sub(read_ms) < fresh_ms => calibration,
            _ => {
                let calibration = read(host, config, rule);
                self.known.insert(rule, (calibration, now_ms));
                calibration
            }
        }
    }

    /// Keeps `lesson` for the next tick, and its samples for the next exchange.
    pub fn note(&mut self, config: &Policy, rule: usize, lesson: Lesson) {
        if config.tokens.calibrate && lesson != Lesson::default() && self.pending.len() < MAX_PENDING_LESSONS {
            self.pending.push((rule, lesson));
        }
        if !config.tokens.share_calibration {
            return;
        }
        let samples = self.outbox.entry(rule).or_insert_with(|| RuleSamples {
            rule: fingerprint_hex(config.tokens.rule(rule)),
            prompt_ratios: Vec::new(),
            outputs: Vec::new(),
        });
        let ratio = lesson.prompt.filter(|&(counted, _)| counted > 0).map(|(c, reported)| reported as f64 / c as f64);
        for (list, sample) in
            [(&mut samples.prompt_ratios, ratio), (&mut samples.outputs, lesson.output.map(|o| o as f64))]
        {
            if let Some(sample) = sample.filter(|_| list.len() < MAX_SAMPLES_PER_EXCHANGE) {
                list.push(sample);
            }
        }
    }

    /// The exchange to send now, if one is due: every rule of the config, with the
    /// samples gathered since the last (the rules without any only ask).
    pub fn exchange(&mut self, config: &Policy, now_ms: u64) -> Option<CalibrationExchange> {
        if !config.tokens.share_calibration || !config.counts_tokens() || self.exchanging.is_some() {
            return None;
        }
        let every = if self.outbox.is_empty() { IDLE_EXCHANGE_MS } else { EXCHANGE_MS };
        if self.last_exchange_ms.is_some_and(|last| now_ms.saturating_sub(last) < every) {
            return None;
        }
        self.last_exchange_ms = Some(now_ms);
        let rules = config
            .tokens
            .all_rules()
            .map(|(index, rule)| {
                self.outbox.remove(&index).unwrap_or_else(|| RuleSamples {
                    rule: fingerprint_hex(rule),
                    prompt_ratios: Vec::new(),
                    outputs: Vec::new(),
                })
            })
            .collect();
        Some(CalibrationExchange { domain: config.domain.clone(), rules })
    }

    /// The exchange was sent as callout `token`.
    pub fn sent(&mut self, token: u32) {
        self.exchanging = Some(token);
    }

    /// Whether callout `token` is the exchange out; it is no longer out after this.
    pub fn is_exchange(&mut self, token: u32) -> bool {
        let ours = self.exchanging == Some(token);
        if ours {
            self.exchanging = None;
        }
        ours
    }

    /// Takes the fleet's figures: each replaces this proxy's own unless the proxy's rests on
    /// more samples (its latest lessons, taken in on a tick after the exchange went out,
    /// which the fleet gets with the next one).
    pub fn take_reply(&mut self, host: &mut impl Host, config: &Policy, reply: &CalibrationReply, now_ms: u64) {
        for figures in &reply.rules {
            let Some((index, _)) = config.tokens.all_rules().find(|(_, rule)| fingerprint_hex(rule) == figures.rule)
            else {
                continue;
            };
            let fleet = Calibration {
                prompt_ratio: figures.prompt_ratio.and_then(Running::from_figure),
                output: figures.output.and_then(Running::from_figure),
            };
            if fleet == Calibration::default() {
                continue; // nothing learned anywhere yet: keep what this proxy has
            }
            if let Some(learned) = rewrite(host, config, index, |own| own.or_fleet(fleet)) {
                self.known.insert(index, (learned, now_ms));
            }
        }
    }

    /// Takes the lessons gathered since the last tick into the shared calibrations.
    pub fn flush(&mut self, host: &mut impl Host, config: &Policy, now_ms: u64) {
        let mut pending = std::mem::take(&mut self.pending);
        pending.sort_by_key(|(rule, _)| *rule); // stable: each rule's lessons stay in order
        for group in pending.chunk_by(|a, b| a.0 == b.0) {
            let Some(&(rule, _)) = group.first() else { continue };
            let lessons: Vec<Lesson> = group.iter().map(|(_, lesson)| *lesson).collect();
            if let Some(learned) = learn(host, config, rule, &lessons) {
                self.known.insert(rule, (learned, now_ms));
            }
        }
    }
}

/// Sets rule `policy`'s gauges, labelled `model_rule`: `prompt_factor_thousandths`, the
/// factor prompts are reserved at (gauges take whole numbers); `output_prior_tokens`, the
/// completion length a tenant without history reserves for (0 while not learned).
pub fn show(host: &mut impl Host, policy: &ModelPolicy, calibration: Calibration) {
    let factor = (calibration.prompt_factor(policy.rule.factor) * 1000.0).round() as u64;
    host.set_gauge(&series::rule_gauge(series::PROMPT_FACTOR, &policy.label), factor);
    let prior = calibration.output_prior().map_or(0, |p| p.round() as u64);
    host.set_gauge(&series::rule_gauge(series::OUTPUT_PRIOR, &policy.label), prior);
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
        // tests/cases/calibration.json is read by tests/test_lua_calibration.py too.
        let table: serde_json::Value =
            serde_json::from_str(include_str!("../../../tests/cases/calibration.json")).expect("calibration.json");
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
