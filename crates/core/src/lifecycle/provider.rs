//! The provider's word (`provider_limits`): what the upstream last said of its own limits
//! for a credential and model, consulted before the request is charged, and heard again in
//! its reply's headers, a throttling body, or a stream's exception.

use super::{RequestFilter, Verdict};
use crate::accounting::reservation::TokenCounts;
use crate::config::Policy;
use crate::effects::host::{Host, Metric};
use crate::effects::provider_state::{self, Judgement};
use crate::effects::provider_word::{self, ProviderWord};
use crate::providers;
use crate::replies::decision;
use crate::worker::Worker;

/// What the provider's word makes of a request.
pub(super) enum ProviderSays {
    /// Refused: the provider has no room for it; answered here.
    Refuse(Verdict),
    /// Refused, and sent to this fallback instead, where it is judged again.
    Overflow(String),
    /// It goes ahead (perhaps as the probe, perhaps against lowered limits).
    Go,
}

impl RequestFilter {
    /// What the provider last said for this request's credential and model: a refusal
    /// answered here (or, when `may_overflow`, sent to `provider_limits.overflow`, to be
    /// judged there), or the request goes ahead, the probe taken or its limits lowered to
    /// what is left.
    pub(super) fn consult_provider(
        &mut self,
        host: &mut impl Host,
        config: &Policy,
        now: u64,
        may_overflow: bool,
    ) -> ProviderSays {
        let Some(plan) = self.plan.as_ref() else { return ProviderSays::Go };
        let key = provider_state::key_of(config, &self.provider.credential, plan.backend.as_deref(), &plan.model);
        self.provider.key = Some(key);
        let estimate = plan.estimate.unwrap_or(TokenCounts { prompt: 0, output: 0 });
        let needs = [1, estimate.prompt.saturating_add(estimate.output), estimate.prompt, estimate.output];
        let (judgement, state) = provider_state::judge(host, config, key, now, needs);
        match judgement {
            Judgement::Refuse { wait_ms, quota } => {
                if let Some(backend) = config.provider_limits.overflow.as_deref().filter(|_| may_overflow) {
                    host.add_metric(Metric::ProviderOverflowed, 1);
                    return ProviderSays::Overflow(backend.to_string());
                }
                host.add_metric(Metric::ProviderRefusalsAnswered, 1);
                let left =
                    |q: provider_word::Quota| state.and_then(|s| s.left.get(q.index()).map(|l| l.0)).unwrap_or(0);
                let short = quota.map(|q| (q.error_type(), q.name(), left(q)));
                return ProviderSays::Refuse(Verdict::Reply(decision::provider_refusal(self.dialect, wait_ms, short)));
            }
            Judgement::Probe => {
                host.add_metric(Metric::ProviderProbes, 1);
                self.provider.mark = Some("probe");
                self.provider.heard = state;
            }
            Judgement::Forward => {}
        }
        let Some(plan) = self.plan.as_mut() else { return ProviderSays::Go };
        let lowered = config.provider_limits.lower_limits
            && state.is_some_and(|state| state.lower(&config.limits, &mut plan.buckets, now));
        if lowered {
            host.add_metric(Metric::ProviderLowered, 1);
            self.provider.mark = self.provider.mark.or(Some("lowered"));
        }
        ProviderSays::Go
    }

    /// Reads what the response's headers say of the provider's limits; a throttling
    /// error whose body may hold its retry time (Google's) is read to its end first.
    pub(super) fn read_provider_headers(&mut self, host: &mut impl Host, config: &Policy) {
        let status: u32 = host.response_header(":status").and_then(|s| s.parse().ok()).unwrap_or(0);
        let now = host.now_ms();
        let word = provider_word::read_headers(status, &mut |name| host.response_header(name), now);
        if !word.said_anything() && !(200..300).contains(&status) {
            // Another error (the upstream down, a bad request) says nothing of the limits.
            return;
        }
        // Google's throttling bodies carry their retry time (RetryInfo): read by the
        // provider the path names, whatever shape `error_format` gives our own answers.
        let google = self.route.as_ref().is_some_and(|route| route.provider == providers::Provider::Gemini);
        if word.refused && word.retry_after_ms.is_none() && google {
            self.provider.pending = Some((word, Vec::new()));
            return;
        }
        self.take_word(host, config, &word);
    }

    pub(super) fn take_word(&mut self, host: &mut impl Host, config: &Policy, word: &ProviderWord) {
        let Some(key) = self.provider.key.take() else { return };
        if word.refused {
            host.add_metric(Metric::ProviderRefusalsSeen, 1);
        }
        self.provider.heard = provider_state::hear(host, config, key, word, self.provider.sent_ms);
    }

    /// The provider refused mid-stream (its reply's headers, heard already, said it
    /// served): heard under the request's key as a refusal, for the fleet's next exchange.
    pub(super) fn hear_mid_stream(&mut self, host: &mut impl Host, config: &Policy, word: &ProviderWord) {
        let Some(plan) = self.plan.as_ref().filter(|_| config.provider_limits.enabled) else { return };
        let key = provider_state::key_of(config, &self.provider.credential, plan.backend.as_deref(), &plan.model);
        self.provider.key = Some(key);
        self.take_word(host, config, word);
    }

    /// Takes in a throttling error's body read so far, and hands what was heard to the
    /// fleet's next exchange.
    pub(super) fn hear_provider(&mut self, host: &mut impl Host, worker: &mut Worker, config: &Policy) {
        if let Some((mut word, body)) = self.provider.pending.take() {
            word.retry_after_ms = provider_word::retry_info_ms(&body);
            self.take_word(host, config, &word);
        }
        if let (Some(state), Some(plan)) = (self.provider.heard.take(), self.plan.as_ref()) {
            let key = provider_state::key_of(config, &self.provider.credential, plan.backend.as_deref(), &plan.model);
            worker.provider_words.note(config, key, state);
        }
    }

    /// Reads the body of a throttling error whose retry time may be in it (Google's),
    /// and hears it at its end.
    pub(super) fn hear_throttling_body(
        &mut self,
        host: &mut impl Host,
        worker: &mut Worker,
        config: &Policy,
        body_size: usize,
        end_of_stream: bool,
    ) {
        if let Some((_, body)) = self.provider.pending.as_mut() {
            let room = provider_word::MAX_ERROR_BODY.saturating_sub(body.len()).min(body_size);
            body.extend_from_slice(host.response_body(body_size).get(..room).unwrap_or_default());
            if end_of_stream {
                self.hear_provider(host, worker, config);
            }
        }
    }
}
