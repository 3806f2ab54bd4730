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
use crate::effects::host::{shared_read, shared_update, Host, SETTLE};
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

/// Lessons of a rule waiting for a tick, at most: once they fill this room the next tick
/// takes them in, and a burst beyond within one tick teaches nothing new.
const MAX_PENDING_LESSONS: usize = 256;

/// A rule's lessons not taken in yet, in order, and what they make of its calibration as
/// the VM knew it at the first (so a tick tells whether they matter without going over
/// them).
#[derive(Debug)]
struct Lessons {
    lessons: Vec<Lesson>,
    known: Option<Calibration>,
    taught: Calibration,
}

/// One VM's side of the shared calibrations, so that they cost a request no host call of
/// its own: lessons are gathered and taken in together on the worker's tick (one
/// compare-and-swap and one pair of gauges per rule whose figures they move, and every
/// rule's once a second), and a rule's value is read from shared data at most once a tick.
/// What moves another worker's figures shows here within a tick or two; what barely moves
/// them, within a second.
#[derive(Debug, Default)]
pub struct VmCalibrations {
    /// Lessons not taken in yet, by rule (bounded by the config's rules).
    pending: rustc_hash::FxHashMap<usize, Lessons>,
    /// Each rule's value as last read or written, and when (bounded by the config's rules).
    known: rustc_hash::FxHashMap<usize, (Calibration, u64)>,
    /// Samples for the next exchange with the other proxies, by rule (bounded by the
    /// config's rules and `MAX_SAMPLES_PER_EXCHANGE`).
    outbox: std::collections::BTreeMap<usize, RuleSamples>,
    pace: super::exchange::ExchangePace,
    /// When the last settling tick ran.
    settled_ms: u64,
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
        if config.tokens.calibrate && lesson != Lesson::default() {
            let known = self.known.get(&rule).map(|&(calibration, _)| calibration);
            let pending = self.pending.entry(rule).or_insert_with(|| Lessons {
                lessons: Vec::new(),
                known,
                taught: known.unwrap_or_default(),
            });
            if pending.lessons.len() < MAX_PENDING_LESSONS {
                pending.lessons.push(lesson);
                pending.taught = pending.taught.learn(lesson);
            }
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

    /// The tick: takes the lessons that move a rule's figures into its shared calibration
    /// (every rule's on the settling tick, once a second, or once the lessons fill their
    /// room); the rest wait, so a steady rule costs a write a second, not one a tick.
    pub fn flush(&mut self, host: &mut impl Host, config: &Policy, now_ms: u64) {
        let settling = now_ms.saturating_sub(self.settled_ms) >= SETTLE.as_millis() as u64;
        self.take_in(host, config, now_ms, settling);
    }

    /// Takes every lesson in (before a new config, whose rules are other ones).
    pub fn settle(&mut self, host: &mut impl Host, config: &Policy, now_ms: u64) {
        self.take_in(host, config, now_ms, true);
        self.known.clear();
    }

    fn take_in(&mut self, host: &mut impl Host, config: &Policy, now_ms: u64, settling: bool) {
        if settling {
            self.settled_ms = now_ms;
        }
        let policy = |rule| config.tokens.rule(rule);
        let due = |pending: &Lessons, rule| {
            settling || pending.lessons.len() >= MAX_PENDING_LESSONS || material(policy(rule), pending)
        };
        let rules: Vec<usize> =
            self.pending.iter().filter(|&(&rule, pending)| due(pending, rule)).map(|(&rule, _)| rule).collect();
        for rule in rules {
            let Some(pending) = self.pending.remove(&rule) else { continue };
            if let Some(learned) = learn(host, config, rule, &pending.lessons) {
                self.known.insert(rule, (learned, now_ms));
            }
        }
    }
}

/// Lessons that move a rule's prompt factor by more than this share of it, or its
/// completion prior by more than `PRIOR_SHARE`, are taken in on the next tick; the rest
/// wait for the settling tick. (The factor scales every prompt's reservation: a share of
/// 1/256 is under a token on most prompts.)
const FACTOR_SHARE: f64 = 1.0 / 256.0;
const PRIOR_SHARE: f64 = 0.125;

/// Whether `pending` moves rule `policy`'s calibration enough to take it in now: any
/// lesson does when the VM knew nothing of the rule.
fn material(policy: &ModelPolicy, pending: &Lessons) -> bool {
    let (Some(before), after) = (pending.known, pending.taught) else { return true };
    let floor = policy.rule.factor;
    let (factor_before, factor_after) = (before.prompt_factor(floor), after.prompt_factor(floor));
    let prior_moved = match (before.output_prior(), after.output_prior()) {
        (Some(prior_before), Some(prior_after)) => {
            (prior_after - prior_before).abs() > PRIOR_SHARE * prior_before.max(1.0)
        }
        (prior_before, prior_after) => prior_before.is_some() != prior_after.is_some(),
    };
    (factor_after - factor_before).abs() > FACTOR_SHARE * factor_before || prior_moved
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
    use crate::effects::host::{HostKind, TICK};
    use crate::testing::{FakeHost, World};
    use std::cell::RefCell;
    use std::rc::Rc;

    fn host_calls(world: &Rc<RefCell<World>>) -> (u64, u64) {
        let world = world.borrow();
        let calls = |name| world.host_calls.get(name).copied().unwrap_or(0);
        (calls("shared_get"), calls("shared_set"))
    }

    fn lesson(counted: u64, reported: u64) -> Lesson {
        Lesson { prompt: Some((counted, reported)), output: None }
    }

    fn config() -> Policy {
        Policy::from_json(
            br#"{"companion": {"upstream": "c", "token": "test-token-0123456789"},
                 "limits": [{"name": "tpm", "tokens": 1000, "window": "1m"}]}"#,
        )
        .expect("config")
    }

    #[test]
    fn lessons_that_move_a_rules_figures_go_out_on_the_tick_and_the_rest_once_a_second() {
        for kind in [HostKind::Envoy, HostKind::Nginx] {
            let config = config();
            let world = World::new(kind);
            let mut host = FakeHost::new(&world);
            let (mut mine, mut other) = (VmCalibrations::default(), VmCalibrations::default());
            let (settle, tick) = (SETTLE.as_millis() as u64, TICK.as_millis() as u64);
            let rule = config.tokens.all_rules().next().map(|(index, _)| index).expect("a rule");
            let factor = |calibration: Calibration| calibration.prompt_factor(config.tokens.rule(rule).rule.factor);
            mine.flush(&mut host, &config, settle);
            assert_eq!(mine.get(&mut host, &config, rule, settle), Calibration::default());
            // The first lesson moves the factor from its floor: it goes out on the next tick.
            mine.note(&config, rule, lesson(100, 200));
            mine.flush(&mut host, &config, settle + tick);
            let first = read(&mut host, &config, rule);
            assert!((factor(first) - 2.0).abs() < 1e-9, "{first:?}");
            assert_eq!(other.get(&mut host, &config, rule, settle + tick), first);
            // The same ratio again moves nothing: no compare-and-swap until the settling tick.
            let before = host_calls(&world);
            for k in 2..settle / tick {
                mine.note(&config, rule, lesson(100, 200));
                mine.flush(&mut host, &config, settle + k * tick);
            }
            assert_eq!(host_calls(&world), before);
            assert_eq!(read(&mut host, &config, rule), first);
            mine.flush(&mut host, &config, 2 * settle);
            let settled = read(&mut host, &config, rule);
            assert_eq!(host_calls(&world).1, before.1 + 1, "one write for the second's lessons");
            assert_eq!(settled.prompt_ratio.map(|r| r.samples), Some(u32::try_from(settle / tick - 1).unwrap_or(0)));
            // A provider that now counts far more moves the factor: out on the next tick, and
            // another worker reading a tick later takes it.
            mine.note(&config, rule, lesson(100, 400));
            mine.flush(&mut host, &config, 2 * settle + tick);
            let moved = read(&mut host, &config, rule);
            assert!(factor(moved) > factor(settled) * 1.01, "{moved:?}");
            assert_eq!(other.get(&mut host, &config, rule, 2 * settle + 2 * tick), moved);
        }
    }

    #[test]
    fn lessons_held_under_a_config_are_taken_in_before_the_next() {
        let config = config();
        let mut host = FakeHost::new(&World::new(HostKind::Envoy));
        let mut calibrations = VmCalibrations::default();
        let (settle, tick) = (SETTLE.as_millis() as u64, TICK.as_millis() as u64);
        let rule = config.tokens.all_rules().next().map(|(index, _)| index).expect("a rule");
        calibrations.flush(&mut host, &config, settle);
        calibrations.get(&mut host, &config, rule, settle);
        calibrations.note(&config, rule, lesson(100, 200));
        calibrations.flush(&mut host, &config, settle + tick);
        calibrations.note(&config, rule, lesson(100, 200));
        calibrations.flush(&mut host, &config, settle + 2 * tick);
        assert_eq!(read(&mut host, &config, rule).prompt_ratio.map(|r| r.samples), Some(1), "the second is held");
        calibrations.settle(&mut host, &config, settle + 2 * tick);
        assert_eq!(read(&mut host, &config, rule).prompt_ratio.map(|r| r.samples), Some(2));
        assert!(calibrations.pending.is_empty());
    }
}
