//! What a request used, once its reply has said: the reply reader chosen from its headers,
//! what it is charged as having used (the figures of its settlement are
//! `plan::settlement`'s), its lessons for the next reservations, and its record and ledger
//! entry. Where the credits go is its admission route's. Names no route.

use super::answer::count_tokens;
use super::{record, Admission, Phase, RequestFilter};
use crate::accounting::calibration::Lesson;
use crate::accounting::reply_floor;
use crate::accounting::reservation::{actual_usage, Ending, TokenCounts};
use crate::api::Api;
use crate::config::{Policy, RecordMode};
use crate::effects::host::{Host, Metric};
use crate::effects::provider_word::{self, ProviderWord};
use crate::plan::series::TokenStage;
use crate::plan::settlement::{self, Settled};
use crate::readers::usage::ReplyReader;
use crate::worker::Worker;

/// Largest SSE event (or Bedrock event-stream message) read for usage; larger SSE events
/// are skipped, a larger event-stream message ends the reading as a bad CRC does.
const MAX_SSE_EVENT: usize = 1 << 20;

/// How a reply ended, for its settlement.
pub(super) struct ReplyEnd {
    pub(super) ending: Ending,
    /// A stream's exception said the provider throttled it mid-stream.
    pub(super) throttled: Option<ProviderWord>,
}

impl RequestFilter {
    /// How the reply is to be read: its status, and for a request with tokens reserved
    /// its encoding and framing.
    pub(super) fn read_reply_headers(&mut self, host: &mut impl Host) {
        // Read once: each read is a call into the host.
        let status: u32 = host.response_header(":status").and_then(|s| s.parse().ok()).unwrap_or(0);
        self.credential_refused = matches!(status, 401 | 403);
        if self.plan.as_ref().is_some_and(|p| p.estimate.is_some()) {
            self.upstream_error = status >= 400;
            self.sight.started = true;
            self.sight.unreadable =
                !reply_floor::readable_encoding(host.response_header("content-encoding").as_deref());
            let content_type = host.response_header("content-type").unwrap_or_default();
            let encoding = self.plan.as_ref().map_or(crate::tokens::Encoding::O200kBase, |p| p.encoding);
            // Gemini streams without `alt=sse` as one JSON array of responses.
            let json_array =
                self.plan.as_ref().and_then(|p| p.request.as_ref()).map(|r| r.api) == Some(Api::StreamGenerateContent);
            let reader = ReplyReader::for_reply(&content_type, json_array, encoding, MAX_SSE_EVENT);
            if !reader.streams_events() {
                self.usage_remover = None;
            }
            self.reply = Some(reader);
        }
    }

    /// How the request was admitted, for its record (while it holds its admission).
    pub(super) fn note_how_admitted(&mut self) {
        if let Some(admission) = &self.admission {
            self.recorded.how = match admission {
                Admission::Reserved(_) | Admission::Charged => record::How::Charged,
                Admission::Leased => record::How::Leased,
                Admission::Degraded { .. } => record::How::Degraded,
                Admission::Stored { .. } => record::How::LocalStore,
            };
        }
    }

    /// Where the access log is written before `on_log` (`HostKind::logs_after_on_log`):
    /// the record as the response begins, at what the request is charged if it is cut off
    /// now (its reservation; an upstream error its prompt), published again when settled
    /// before the log phase.
    pub(super) fn publish_provisional_record(&mut self, host: &mut impl Host, config: &Policy) {
        self.note_how_admitted();
        let Some(plan) = self.plan.as_ref() else { return self.publish_record_now(host, config) };
        if let (Some(estimate), Some(_)) = (self.reserved(), &self.admission) {
            let used = if self.upstream_error { TokenCounts { output: 0, ..estimate } } else { estimate };
            let price = plan.settlement_price(config, None);
            self.recorded.used = record::Used {
                input: used.prompt,
                output: used.output,
                cost_micro_usd: price.map_or(0, |price| price.micro_usd_cached(used, 0)),
                ..record::Used::default()
            };
        }
        self.publish_record_now(host, config);
    }

    /// Publishes the request's record, once (`record`).
    pub(super) fn publish_record(&mut self, host: &mut impl Host, config: &Policy) {
        if self.recorded.published {
            return;
        }
        self.publish_record_now(host, config);
        self.recorded.published = true;
    }

    pub(super) fn publish_record_now(&mut self, host: &mut impl Host, config: &Policy) {
        if config.record == RecordMode::Off {
            return;
        }
        // Each pool's claimant, borrowed from the plan's buckets (one per limit, in order).
        let buckets = self.plan.as_ref().map_or(&[][..], |plan| plan.buckets.as_slice());
        let owners = config
            .limits
            .iter()
            .zip(buckets)
            .filter_map(|(limit, bucket)| Some((limit.name.as_str(), bucket.owner.as_deref()?)));
        let route = self.route.as_ref();
        let record = record::Record {
            tenant: &self.tenant,
            owners: owners.collect(),
            provider: route.map(|r| r.provider),
            api: self
                .plan
                .as_ref()
                .and_then(|p| p.request.as_ref())
                .map(|r| r.api)
                .or_else(|| route.and_then(|r| r.api)),
            model: self.plan.as_ref().map_or("", |p| p.model.as_str()),
            used: self.recorded.used,
            how: self.recorded.how,
            refused_by: self.recorded.refused_by.as_deref(),
            queued_ms: self.recorded.queued_ms,
            overflow: self.overflow.as_deref(),
            shadow: self.recorded.shadow,
        };
        record::publish(host, self.host_kind, config.record, &record);
    }

    /// Adds what the request's record says it used to the worker's ledger aggregate, under
    /// its tenant and each pool's claimant: every request with a tenant, with exactly the
    /// record's counts, but a refused one that used nothing (a refusal is not a request
    /// served). Only with the companion (`store: redis`): the local store keeps no ledger.
    pub(super) fn add_to_ledger(&mut self, host: &mut impl Host, worker: &mut Worker, config: &Policy) {
        if std::mem::replace(&mut self.recorded.in_ledger, true) {
            return;
        }
        let refused = matches!(self.recorded.how, record::How::Refused | record::How::Suspended)
            && self.recorded.used == record::Used::default();
        // A credential the upstream refused did no work and is refunded; its row would
        // keep an id a client may have invented in Redis for the retention.
        let invented = self.credential_refused && self.phase == Phase::Forwarded;
        if config.store != crate::config::Store::Redis || self.tenant.is_empty() || refused || invented {
            return;
        }
        let used = self.recorded.used;
        let entry = crate::accounting::ledger::Entry {
            tenant: &self.tenant,
            pools: &self.recorded.pools,
            model: self.plan.as_ref().map_or("", |p| p.model.as_str()),
            day: worker.ledger.day_of_ms(host.now_ms()),
            used: crate::protocol::ledger::Spent {
                requests: 1,
                input_tokens: used.input,
                output_tokens: used.output,
                cached_tokens: used.cached,
                reasoning_tokens: used.reasoning,
                cost_micro_usd: used.cost_micro_usd,
            },
        };
        worker.ledger.add(&entry);
    }

    /// What gives back all this request took from each limit but slots (released on
    /// their own): requests, tokens and dollars alike.
    pub(super) fn refund_everything(&self, config: &Policy) -> Vec<(usize, i64)> {
        self.plan.as_ref().map(|plan| settlement::refund_everything(config, plan)).unwrap_or_default()
    }

    /// A release of each slot limit (credit 0) this request's charge would hold.
    pub(super) fn slot_releases(&self, config: &Policy) -> Vec<(usize, i64)> {
        self.plan.as_ref().map(|plan| settlement::slot_releases(config, plan)).unwrap_or_default()
    }

    /// What to give back for this request (negative: to take) to each token and cost
    /// limit it applies to (per-model limits may not), by limit index: of the part of its
    /// tokens the limit counts, or in micro-dollars, what it reserved less what the reply
    /// says it used. Updates the running average of completions.
    pub(super) fn credits(
        &mut self,
        host: &mut impl Host,
        worker: &mut Worker,
        config: &Policy,
        ending: Ending,
    ) -> Vec<(usize, i64)> {
        let Some(estimate) = self.reserved() else { return Vec::new() };
        let Some(plan) = self.plan.as_ref() else { return Vec::new() };
        if plan.charged_most {
            return Vec::new();
        }
        let read = self.reply.as_mut().map(ReplyReader::finish).unwrap_or_default();
        if let Some(why) = read.broken {
            host.warn_once(
                "event-stream",
                &format!(
                    "llm-ratelimit: a Bedrock event stream stopped being read ({why:?}); settled on what came before"
                ),
            );
        }
        let (reported, streamed_output, reply_model) = (read.reported, read.streamed_output, read.model);
        // Of a JSON reply, the bytes of text that passed to the client, for a cut one.
        let passed_text_bytes = read.passed_text_bytes;
        let price = plan.settlement_price(config, reply_model);
        let forwarded = self.phase == Phase::Forwarded;
        // A request that never went upstream cost nothing.
        self.sight.stream_without_usage = streamed_output.is_some() && reported.output.is_none();
        // Matched only where it can matter (a stream that ended without its usage): the
        // patterns are many (13 by default) and most replies report their usage.
        self.sight.hidden_output_model = self.sight.stream_without_usage
            && reply_floor::hides_output(&config.tokens.hidden_output_models, &plan.model);
        let floor = reply_floor::floor(ending, self.sight, config.tokens.on_client_abort).filter(|_| forwarded);
        let used = if forwarded {
            let used = actual_usage(estimate, ending, reported, streamed_output, config.tokens.on_upstream_error);
            settlement::floored(plan, estimate, used, floor, reported.output.is_some(), passed_text_bytes)
        } else {
            TokenCounts { prompt: 0, output: 0 }
        };
        host.add_metric(Metric::TokensCharged, used.total());
        count_tokens(host, config, plan.rule, TokenStage::Charged, used);
        // A reply the filter could not read teaches nothing: its visible part would teach
        // the next reservations that completions are short.
        if ending == Ending::Completed && forwarded && floor.is_none() {
            let output = reported.output.or(streamed_output).filter(|_| plan.produces_output());
            if let Some(output) = output {
                worker.averages.teach(host, config, &self.tenant, &plan.model, output);
            }
            // What the provider counted against what the proxy did, for the next reservations.
            let prompt = reported.input.map(|input| (plan.counted_prompt, input));
            worker.calibrations.note(config, plan.rule, Lesson { prompt, output });
        }
        let cached = if forwarded { reported.cached_input.unwrap_or(0) } else { 0 };
        self.recorded.used = record::Used {
            input: used.prompt,
            output: used.output,
            cached,
            reasoning: if forwarded { reported.reasoning.unwrap_or(0) } else { 0 },
            cost_micro_usd: price.map_or(0, |price| price.micro_usd_cached(used, cached)),
        };
        settlement::credits(config, plan, Settled { reserved: estimate, used, cached, price })
    }

    /// Reads a chunk of the reply for its usage (and takes out the usage chunks the filter
    /// asked for and the client did not): at its end, how it ended.
    pub(super) fn read_reply(
        &mut self,
        host: &mut impl Host,
        body_size: usize,
        end_of_stream: bool,
    ) -> Option<ReplyEnd> {
        if self.reply.is_none() || self.admission.is_none() {
            return None;
        }
        let chunk = host.response_body(body_size);
        if let Some(reader) = self.reply.as_mut() {
            reader.feed(&chunk);
        }
        if let Some(passed) = self.usage_remover.as_mut().and_then(|remover| remover.filter(&chunk, end_of_stream)) {
            if !host.replace_response_body(body_size, &passed) {
                host.warn_once("response-body", "llm-ratelimit: the host refused to rewrite a response body");
            }
        }
        if !end_of_stream {
            return None;
        }
        // A Bedrock stream that carried an exception ended before its reply did, and
        // teaches nothing. Throttling is the provider's rate limit stopping the model:
        // settled at the prompt and what was streamed (all it generated), and heard
        // as the provider's refusal. Any other is settled as an interrupted reply.
        let exception = self.reply.as_ref().and_then(ReplyReader::exception).map(str::to_string);
        let throttled = exception.as_deref().and_then(provider_word::read_stream_exception);
        let ending = match (self.upstream_error, &exception, &throttled) {
            (true, _, _) => Ending::UpstreamError,
            (false, _, Some(_)) => Ending::Throttled,
            (false, Some(_), None) => Ending::Interrupted,
            (false, None, None) => Ending::Completed,
        };
        // Heard as the provider's refusal only when it is what ended the reply.
        let throttled = throttled.filter(|_| ending == Ending::Throttled);
        Some(ReplyEnd { ending, throttled })
    }
}
