//! What every route shares to answer a request: counting an admission or a refusal, the
//! 429 and the rate-limit headers, the body rewritten to the grant, and carrying a verdict
//! out (as shadow mode has it). Names no route.

use super::{record, Phase, RequestFilter, Verdict};
use crate::accounting::reservation::TokenCounts;
use crate::config::{Mode, Policy};
use crate::effects::host::{Action, Host, Metric};
use crate::parse::sse::UsageChunkRemover;
use crate::plan::series::{self, Decision, TokenStage, TokenType};
use crate::protocol::{LimitStatus, LimitsReply, Suspension};
use crate::replies::answers::{self, Caller};
use crate::replies::decision::{self, OVERFLOW_HEADER, PROVIDER_HEADER, RESERVED_TOKENS_HEADER, SHADOW_HEADER};
use crate::replies::reply::Header;
use crate::worker::Worker;

impl RequestFilter {
    /// An admission: counted in `requests_allowed` and under every limit that applies.
    pub(super) fn count_admission(&self, host: &mut impl Host, config: &Policy, decision: Decision) {
        host.add_metric(Metric::Allowed, 1);
        self.count_per_limit(host, config, decision);
    }

    pub(super) fn count_per_limit(&self, host: &mut impl Host, config: &Policy, decision: Decision) {
        self.count_per_limit_in(host, config, decision, None);
    }

    /// As `count_per_limit`, a shadow limit that had no room in `reply` counted as
    /// `shadow` (it refused nothing).
    pub(super) fn count_per_limit_in(
        &self,
        host: &mut impl Host,
        config: &Policy,
        decision: Decision,
        reply: Option<&LimitsReply>,
    ) {
        let Some(plan) = self.plan.as_ref() else { return };
        for limit in (0..config.limits.len()).filter(|&i| plan.applies(i)) {
            let short = reply.and_then(|r| r.limits.get(limit)).is_some_and(|o| o.status != LimitStatus::Allowed);
            let shadowed = config.limits.get(limit).is_some_and(|l| l.shadow) && short;
            host.add_series(series::decision(limit, if shadowed { Decision::Shadow } else { decision }), 1);
        }
    }

    /// A refusal: counted in `requests_limited` and under each limit that had no room
    /// (as `shadow` when shadow mode lets it through).
    pub(super) fn count_refusal(&mut self, host: &mut impl Host, config: &Policy, reply: &LimitsReply) {
        host.add_metric(Metric::Limited, 1);
        let decision = if config.mode == Mode::Shadow { Decision::Shadow } else { Decision::Limited };
        let relevant = self.relevant(reply);
        // The limit the 429 names: one that can never fit, else the one binding longest.
        let never = relevant.limits.iter().find(|o| o.status == LimitStatus::Never);
        let binding = never.or_else(|| {
            relevant.limits.iter().filter(|o| o.status == LimitStatus::Limited).max_by_key(|o| o.retry_after_ms)
        });
        self.recorded.refused_by = binding.map(|o| o.name.clone());
        let refusing = relevant.limits.iter().filter(|o| o.status != LimitStatus::Allowed).map(|o| o.name.as_str());
        for limit in series::limit_indices(config, refusing) {
            // A shadow limit with no room refused nothing: the others did.
            let shadowed = config.limits.get(limit).is_some_and(|l| l.shadow);
            host.add_series(series::decision(limit, if shadowed { Decision::Shadow } else { decision }), 1);
        }
    }

    /// The 429 for `reply`, decided at `now` (ms).
    pub(super) fn rejection(&self, config: &Policy, reply: &LimitsReply, now: u64) -> Verdict {
        let charged = self.plan.as_ref().map_or(&[][..], |p| p.buckets.as_slice());
        Verdict::Reply(decision::rejection(&self.relevant(reply), config, charged, self.caller(now)))
    }

    /// Who the filter's answers to this request are for, at `now` (ms).
    pub(super) fn caller(&self, now: u64) -> Caller {
        Caller { dialect: self.dialect, now_ms: now }
    }

    pub(super) fn admitted_headers(
        &self,
        host: &mut impl Host,
        config: &Policy,
        reply: LimitsReply,
        now: u64,
    ) -> Vec<Header> {
        let reply = self.keep_relevant(reply);
        let mut headers = decision::rate_limit_headers(&reply, config, self.caller(now));
        headers.extend(decision::budget_low(&reply, config, now));
        if let (Some(plan), Some(reserved)) = (self.plan.as_ref(), self.reserved()) {
            count_tokens(host, config, plan.rule, TokenStage::Reserved, reserved);
            host.add_metric(Metric::TokensReserved, reserved.total());
            headers.push((RESERVED_TOKENS_HEADER, decision::decimal(reserved.total())));
        }
        headers
    }

    /// Sends upstream the body the charge calls for: the output cap clamped to what was
    /// granted, stream usage requested. Only while the headers are still held can
    /// content-length follow the new body, so nothing changes otherwise.
    pub(super) fn rewrite_body(&mut self, host: &mut impl Host, config: &Policy, reply: &LimitsReply) {
        let signed = self.plan.as_ref().and_then(|p| p.request.as_ref()).is_some_and(|r| r.body_is_signed);
        if signed {
            // Reserved at its whole cap instead (see `charge::plan`).
            if config.tokens.clamp_max_tokens {
                host.add_metric(Metric::SignedNotClamped, 1);
            }
            return;
        }
        if !self.holding_headers {
            return;
        }
        let Some(plan) = self.plan.as_ref() else { return };
        let charged: Vec<u64> = reply.limits.iter().map(|o| o.charged).collect();
        self.grant = plan.grant(&charged);
        let Some(body) = plan.body_for(config, self.grant) else { return };
        if host.replace_request_body(self.body_len, &body)
            && host.set_request_header("content-length", &body.len().to_string())
            && config.tokens.request_stream_usage
            && plan.request.as_ref().is_some_and(|r| r.wants_usage_added())
        {
            self.usage_remover = Some(UsageChunkRemover::default());
        }
    }

    /// Carries a verdict out, as shadow mode has it. `paused` says whether the request is
    /// waiting on us.
    pub(super) fn apply(&mut self, host: &mut impl Host, config: &Policy, verdict: Verdict, paused: bool) -> Action {
        let verdict = self.shadow(host, config, verdict);
        self.carry_out(host, verdict, paused)
    }

    /// In shadow mode a refusal is forwarded instead, marked with what it would have been.
    pub(super) fn shadow(&mut self, host: &mut impl Host, config: &Policy, verdict: Verdict) -> Verdict {
        match verdict {
            Verdict::Reply(reply) if config.mode == Mode::Shadow && matches!(reply.status, 403 | 413 | 429 | 503) => {
                host.add_metric(Metric::ShadowRefusals, 1);
                self.recorded.shadow = true;
                let mut headers: Vec<Header> = reply
                    .headers
                    .into_iter()
                    .filter(|(name, _)| *name != "retry-after" && !answers::belongs_to_the_error(name))
                    .collect();
                let would = if self.shadow_overflow { "overflow".to_string() } else { reply.status.to_string() };
                headers.push((SHADOW_HEADER, would.into()));
                Verdict::Forward(headers)
            }
            other => other,
        }
    }

    pub(super) fn carry_out(&mut self, host: &mut impl Host, verdict: Verdict, paused: bool) -> Action {
        match verdict {
            Verdict::Forward(mut headers) => {
                self.phase = Phase::Forwarded;
                self.provider.sent_ms = host.now_ms();
                if let Some(mark) = self.provider.mark {
                    headers.push((PROVIDER_HEADER, mark.into()));
                }
                if let Some(backend) = &self.overflow {
                    // The route table (Envoy clears its route cache on a header the filter
                    // sets) or the config's `map` (Nginx) sends the request there.
                    if !host.set_request_header(OVERFLOW_HEADER, backend) {
                        host.warn_once("overflow", "llm-ratelimit: the host refused the overflow request header");
                    }
                    headers.push((OVERFLOW_HEADER, backend.as_str().into()));
                }
                self.response_headers = headers;
                if paused {
                    host.resume_request();
                }
                Action::Continue
            }
            Verdict::Reply(mut reply) => {
                self.phase = Phase::Replied;
                if self.recorded.how != record::How::Suspended {
                    self.recorded.how = record::How::Refused;
                }
                // Final now, and before the log phase, whatever the host.
                if let Some(config) = self.config.clone() {
                    self.publish_record(host, &config);
                }
                // Nothing goes upstream: nothing will be heard.
                self.provider.key = None;
                self.response_headers.clear();
                // OpenAI's SDK reads `x-request-id`, Anthropic's `request-id`: a caller can
                // quote either when it asks why it was refused.
                if !self.request_id.is_empty() {
                    reply.headers.push(("x-request-id", self.request_id.as_str().into()));
                    reply.headers.push(("request-id", self.request_id.as_str().into()));
                }
                host.send_reply(&reply);
                Action::Pause
            }
            // The fallback's charge is out: its answer resumes the request or refuses it.
            Verdict::Recharging => Action::Pause,
        }
    }

    /// A refusal because an owner of the request is suspended by its plan: counted,
    /// recorded, and remembered by the VM for the degraded mode. Nothing was charged. The
    /// suspended owner, when the limit is one of the request's.
    pub(super) fn note_suspension(
        &mut self,
        host: &mut impl Host,
        worker: &mut Worker,
        config: &Policy,
        suspension: &Suspension,
        now: u64,
    ) -> Option<String> {
        self.admission = None; // nothing was charged
        host.add_metric(Metric::Limited, 1);
        host.add_metric(Metric::Suspended, 1);
        self.recorded.how = record::How::Suspended;
        self.recorded.refused_by = Some(suspension.limit.clone());
        let owner = self.owner_of(config, &suspension.limit)?;
        worker.owner_plans.suspend(&owner, &suspension.reason, now);
        Some(owner)
    }
}

/// Tokens by `gen_ai.token.type`: the prompt is input, the completion output.
pub(super) fn count_tokens(host: &mut impl Host, config: &Policy, rule: usize, stage: TokenStage, tokens: TokenCounts) {
    for (kind, amount) in [(TokenType::Input, tokens.prompt), (TokenType::Output, tokens.output)] {
        if amount > 0 {
            host.add_series(series::tokens(config, rule, kind, stage), amount);
        }
    }
}
