//! The worker's callouts to the companion: how one is made and its answer read, the
//! breaker that says whether to make one (its state in shared data, behind one typed
//! read-modify-write), and the fleet's exchanges of calibrations and providers' words.

use super::{RootAnswer, Worker};
use crate::accounting::breaker::{Breaker, Dispatch};
use crate::config::Policy;
use crate::effects::host::{shared_read, shared_update, Host, LogLevel, Metric, Owner};
use crate::protocol::keys;
use crate::protocol::{CalibrationReply, ProviderReply, CALIBRATION_PATH, PROVIDER_PATH, TOKEN_HEADER};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::time::Duration;

/// Settlement batches, slot heartbeats and exchanges wait at least this long for the
/// companion.
pub(super) const BACKGROUND_TIMEOUT: Duration = Duration::from_secs(1);

impl Worker {
    /// Takes the answer to a fleet exchange (calibrations, provider words) if `token` is
    /// one's; whether it was.
    pub(super) fn exchange_answered(&mut self, host: &mut impl Host, config: &Policy, answer: RootAnswer) -> bool {
        let RootAnswer { token, body_size } = answer;
        if self.calibrations.is_exchange(token) {
            match callout_reply::<CalibrationReply>(host, body_size) {
                Ok(reply) => {
                    let now = host.now_ms();
                    self.calibrations.take_reply(host, config, &reply, now);
                }
                Err(why) => host.log(LogLevel::Debug, &format!("llm-ratelimit: calibration exchange failed: {why}")),
            }
            return true;
        }
        if self.provider_words.is_exchange(token) {
            match callout_reply::<ProviderReply>(host, body_size) {
                Ok(reply) => {
                    let now = host.now_ms();
                    self.provider_words.take_reply(host, config, &reply, now);
                }
                Err(why) => host.log(LogLevel::Debug, &format!("llm-ratelimit: provider words exchange failed: {why}")),
            }
            return true;
        }
        false
    }

    /// Sends a JSON POST to the companion; returns the callout token.
    pub(crate) fn call_companion(
        &self,
        host: &mut impl Host,
        config: &Policy,
        path: &str,
        message: &impl Serialize,
        timeout: Duration,
        owner: Owner,
    ) -> Result<u32, String> {
        let body = serde_json::to_vec(message).map_err(|e| e.to_string())?;
        let companion = &config.companion;
        let headers = [
            (":method", "POST"),
            (":path", path),
            (":authority", companion.authority()),
            ("content-type", "application/json"),
            (TOKEN_HEADER, companion.token.expose()),
        ];
        host.dispatch(&companion.upstream, &headers, &body, timeout, owner)
            .map_err(|why| format!("callout to {:?} refused by the host: {why}", companion.upstream))
    }

    pub(crate) fn breaker(&self, host: &mut impl Host, config: &Policy) -> Breaker {
        shared_read(host, &keys::breaker_key(&config.domain)).and_then(|b| Breaker::from_bytes(&b)).unwrap_or_default()
    }

    /// The breaker's one read-modify-write: `change` takes its state and returns the next
    /// one (`None`: unchanged) and what to answer; `None` if the host refused every write.
    fn update_breaker<R>(
        host: &mut impl Host,
        config: &Policy,
        mut change: impl FnMut(Breaker) -> (Option<Breaker>, R),
    ) -> Option<R> {
        shared_update(host, &keys::breaker_key(&config.domain), |bytes| {
            let (next, answer) = change(bytes.and_then(Breaker::from_bytes).unwrap_or_default());
            (next.map(|state| state.to_bytes().to_vec()), answer)
        })
    }

    /// Where a decision goes now: to the companion, or local while the breaker is open.
    pub(crate) fn dispatch(&mut self, host: &mut impl Host, config: &Policy, now: u64) -> Dispatch {
        let cooldown = config.fallback.breaker_cooldown.as_millis() as u64;
        Self::update_breaker(host, config, |state| {
            let (chosen, probe) = state.dispatch(now, cooldown);
            (probe, chosen)
        })
        .unwrap_or(Dispatch::Local)
    }

    pub(crate) fn callout_succeeded(&mut self, host: &mut impl Host, config: &Policy) {
        let reopened = Self::update_breaker(host, config, |state| {
            let changed = state != Breaker::default();
            (changed.then(|| state.on_success()), !state.is_closed())
        });
        if reopened == Some(true) {
            host.log(LogLevel::Info, "llm-ratelimit: the companion answers again; leaving degraded mode");
        }
    }

    pub(crate) fn record_callout_failure(&mut self, host: &mut impl Host, config: &Policy) {
        let cooldown = config.fallback.breaker_cooldown.as_millis() as u64;
        let now = host.now_ms();
        let opened = Self::update_breaker(host, config, |state| {
            let next = state.on_failure(now, config.fallback.breaker_failures, cooldown);
            (Some(next), (state.is_closed() && !next.is_closed()).then_some(next.consecutive_failures))
        });
        if let Some(failures) = opened.flatten() {
            host.log(
                LogLevel::Warn,
                &format!("llm-ratelimit: {failures} failed callouts in a row; deciding locally for {cooldown} ms before probing"),
            );
        }
    }

    /// Hands this worker's new calibration samples to the companion, when an exchange is due.
    pub(super) fn exchange_calibrations(&mut self, host: &mut impl Host, config: &Policy, now: u64) {
        let Some(exchange) = self.calibrations.exchange(config, now) else { return };
        match self.call_companion(host, config, CALIBRATION_PATH, &exchange, BACKGROUND_TIMEOUT, Owner::Root) {
            Ok(token) => self.calibrations.sent(token),
            Err(why) => host.log(LogLevel::Debug, &format!("llm-ratelimit: no calibration exchange: {why}")),
        }
    }

    /// Hands what this worker heard from providers to the companion, and takes the
    /// fleet's, when an exchange is due.
    pub(super) fn exchange_provider_words(&mut self, host: &mut impl Host, config: &Policy, now: u64) {
        let Some(exchange) = self.provider_words.exchange(host, config, now) else { return };
        match self.call_companion(host, config, PROVIDER_PATH, &exchange, BACKGROUND_TIMEOUT, Owner::Root) {
            Ok(token) => self.provider_words.sent(token),
            Err(why) => host.log(LogLevel::Debug, &format!("llm-ratelimit: no provider words exchange: {why}")),
        }
    }
}

/// The companion's reply to the callout being delivered, if it is a usable one.
pub(crate) fn callout_reply<T: DeserializeOwned>(host: &mut impl Host, body_size: usize) -> Result<T, String> {
    let status = host.callout_status();
    if status == Some(401) {
        // Not an outage: the companion is up and refuses this filter's token. Every
        // decision stays local until someone fixes the config, so say so loudly, once per
        // VM (not once per request), and count it apart from failures.
        host.add_metric(Metric::CalloutCredentialRefusals, 1);
        host.warn_once(
            "companion-credentials",
            "llm-ratelimit: credential mismatch: the companion refused this filter's token (401); \
             `companion.token` does not match the companion's token, so every decision is made locally \
             (failure_mode) until they match. This is a configuration error, not an outage",
        );
        return Err("companion refused the filter's credentials (401)".into());
    }
    if status != Some(200) {
        return Err(format!("companion answered status {status:?}"));
    }
    serde_json::from_slice(&host.callout_body(body_size)).map_err(|e| format!("companion reply is not valid: {e}"))
}
