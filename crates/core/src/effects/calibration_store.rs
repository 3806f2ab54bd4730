//! Where the calibrations live. One value per rule (the operator's, the built-in
//! families, one catch-all for every other model) in shared data, so every worker of a
//! proxy learns from every other's replies and the memory is bounded by the config,
//! whatever model names clients send. Each value is tagged with its rule's pattern and
//! encoding, so after a config change that moved the rules a value that was another
//! rule's reads as absent.
//!
//! Across proxies (`tokens.share_calibration`): each worker hands its new samples to the
//! companion about once a second (every 30 s when it learned nothing, and on its first
//! tick) and takes back the figures all proxies taught, per rule fingerprint, which
//! replace the proxy's own: a proxy that starts later reserves at what the fleet learned
//! from its first request. Samples of an exchange that fails are lost to the fleet only
//! (the proxy learned them already).

use crate::accounting::calibration::{Calibration, Lesson, Running};
use crate::config::{ModelPolicy, Policy};
use crate::effects::host::{shared_read, shared_update, Host};
use crate::effects::tables::fnv1a;
use crate::plan::series;
use crate::protocol::{keys, CalibrationExchange, CalibrationReply, RuleSamples, MAX_SAMPLES_PER_EXCHANGE};

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
pub struct VmCalibrations {
    pending: Vec<(usize, Lesson)>,
    /// Each rule's value as last read or written, and when (bounded by the config's rules).
    known: rustc_hash::FxHashMap<usize, (Calibration, u64)>,
    /// Samples for the next exchange with the other proxies, by rule (bounded by the
    /// config's rules and `MAX_SAMPLES_PER_EXCHANGE`).
    outbox: std::collections::BTreeMap<usize, RuleSamples>,
    pace: super::exchange::ExchangePace,
}

/// How often a worker that learned something exchanges it, and how often one that did not
/// asks what the others learned.
pub const EXCHANGE_MS: u64 = 1_000;
pub const IDLE_EXCHANGE_MS: u64 = 30_000;

impl VmCalibrations {
    /// What this proxy has learned about rule `rule` (nothing when calibration is off).
    pub fn get(&mut self, host: &mut impl Host, config: &Policy, rule: usize, now_ms: u64) -> Calibration {
        if !config.tokens.calibrate {
            return Calibration::default();
        }
        let fresh_ms = crate::effects::host::TICK.as_millis() as u64;
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
        let every = if self.outbox.is_empty() { IDLE_EXCHANGE_MS } else { EXCHANGE_MS };
        if !config.tokens.share_calibration || !config.counts_tokens() || !self.pace.due(now_ms, every) {
            return None;
        }
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
        self.pace.sent(token);
    }

    /// Whether callout `token` is the exchange out; it is no longer out after this.
    pub fn is_exchange(&mut self, token: u32) -> bool {
        self.pace.is_reply(token)
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
