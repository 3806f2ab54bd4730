//! Who a request is for and what it is charged: its tenant, from the places its upstream
//! authenticates (or the operator's own headers), the credential the upstream sees, its
//! tier, and the plan of its charge.

use super::{is_request_id, single_header, RequestFilter, Verdict};
use crate::accounting::calibration::Calibration;
use crate::accounting::reservation::OutputAverage;
use crate::api::dialect::Dialect;
use crate::api::identity::MissingIdentity;
use crate::api::identity::{read_credential, tenant_id, Credential, IdentitySource, TenantIds, ANONYMOUS_TENANT};
use crate::config::{Policy, UnknownPaths, UnreadableBody};
use crate::effects::average_store::VmAverages;
use crate::effects::calibration_store::VmCalibrations;
use crate::effects::host::{Host, Metric};
use crate::plan::charge::{plan, Learned};
use crate::providers;
use crate::replies::decision;
use crate::tokens::prompt_cache::PromptCache;
use crate::tokens::Encoding;
use crate::worker::Worker;

/// What a request's headers say of it, before its charge is planned.
pub(super) enum Recognised {
    /// Let through untouched (`bypass`).
    Bypassed,
    /// Refused before it is charged: a path no API is recognised in (or a batch or
    /// realtime one), a credential missing or given twice.
    Refused(Verdict),
    /// Its tenant is known.
    Identified,
}

impl RequestFilter {
    /// Reads what the request's headers say of it before any budget is consulted: its id,
    /// its path (the API, the shape of the filter's answers), its tenant, and the
    /// credential its upstream sees.
    pub(super) fn recognise(&mut self, host: &mut impl Host, worker: &mut Worker, config: &Policy) -> Recognised {
        let raw_path = host.request_header(":path").unwrap_or_default();
        // The one reading of the path: bypass and routing both see it.
        let path = crate::parse::path::normalised(&raw_path);
        self.request_id = match host.request_header("x-request-id") {
            Some(id) if is_request_id(&id) => id,
            _ => "llmrl-".to_string() + &worker.new_reservation_id(host),
        };
        if !config.bypass.paths.is_empty() && config.bypass.path(&path) {
            host.add_metric(Metric::Bypassed, 1);
            return Recognised::Bypassed;
        }
        self.route = providers::route_normalised(&path);
        // Known before any body, so every answer, even one that never reads it, is in the
        // caller's shape.
        self.dialect = config.error_format.dialect(self.route.as_ref().map_or(Dialect::OpenAi, |route| route.dialect));
        let unknown = self.route.is_none() && config.unknown_paths == UnknownPaths::Refuse;
        if unknown || crate::parse::path::is_batch_or_realtime(&path) {
            return Recognised::Refused(Verdict::Reply(decision::path_refused(self.dialect)));
        }
        match self.identify(host, config, &raw_path, &mut worker.tenant_ids) {
            Ok(tenant) => self.tenant = tenant,
            Err(verdict) => return Recognised::Refused(verdict),
        }
        if config.provider_limits.enabled {
            self.provider.credential = match config.identity.sources {
                None => self.tenant.clone(),
                Some(_) => self.upstream_credential(host, &raw_path),
            };
        }
        if config.bypass.tenant(&self.tenant) {
            host.add_metric(Metric::Bypassed, 1);
            return Recognised::Bypassed;
        }
        Recognised::Identified
    }

    /// The tenant, from the places the request's upstream authenticates (or the
    /// operator's own headers): all of them, so that two credentials are refused rather
    /// than one chosen.
    pub(super) fn identify(
        &self,
        host: &mut impl Host,
        config: &Policy,
        path: &str,
        ids: &mut TenantIds,
    ) -> Result<String, Verdict> {
        let query = path.split_once('?').map_or("", |(_, query)| query.split('#').next().unwrap_or(""));
        let values = |name: &str| host.request_header_values(name);
        let credential = match (&config.identity.sources, &self.route) {
            (Some(sources), _) => read_credential(sources.iter().map(IdentitySource::place), values, ""),
            (None, Some(route)) => read_credential(route.provider.credentials().iter().copied(), values, query),
            (None, None) => read_credential(providers::EVERY_CREDENTIAL_PLACE, values, query),
        };
        match (credential, config.identity.missing) {
            (Credential::Conflicting, _) => {
                host.add_metric(Metric::Unidentified, 1);
                Err(Verdict::Reply(decision::conflicting_credentials(self.dialect)))
            }
            (Credential::Found(credential), _) => Ok(ids.of(&credential)),
            (Credential::Missing, MissingIdentity::Anonymous) => Ok(ANONYMOUS_TENANT.to_string()),
            (Credential::Missing, MissingIdentity::Reject) => {
                host.add_metric(Metric::Unidentified, 1);
                Err(Verdict::Reply(decision::missing_identity(self.dialect)))
            }
        }
    }

    /// The id of the credential the upstream sees, from its API's own places (the
    /// operator identifies tenants otherwise); `anonymous` when there is none (a later
    /// filter adds it: one credential for every request).
    pub(super) fn upstream_credential(&self, host: &mut impl Host, path: &str) -> String {
        let query = path.split_once('?').map_or("", |(_, query)| query.split('#').next().unwrap_or(""));
        let values = |name: &str| host.request_header_values(name);
        let credential = match &self.route {
            Some(route) => read_credential(route.provider.credentials().iter().copied(), values, query),
            None => read_credential(providers::EVERY_CREDENTIAL_PLACE, values, query),
        };
        match credential {
            Credential::Found(credential) => tenant_id(&credential),
            Credential::Missing | Credential::Conflicting => ANONYMOUS_TENANT.to_string(),
        }
    }

    /// Plans the request's charge (its tier, what it costs each limit, the pools it is
    /// charged in) and reads the clock once for its decision: that time, or the answer to
    /// a request that cannot be charged. `body` is `None` when the body is not read.
    pub(super) fn plan_request(
        &mut self,
        host: &mut impl Host,
        worker: &mut Worker,
        config: &Policy,
        body: Option<&[u8]>,
    ) -> Result<u64, Verdict> {
        let tier_value = config.tier.as_ref().and_then(|t| single_header(host, &t.header));
        self.tier = config.tier_of(&self.tenant, tier_value.as_deref()).to_string();
        // The clock, read once for the decision.
        let now = host.now_ms();
        let mut learned = ProxyKnowledge {
            host,
            now,
            config,
            tenant: &self.tenant,
            prompt_cache: &mut worker.prompt_cache,
            calibrations: &mut worker.calibrations,
            averages: &mut worker.averages,
        };
        let mut plan = plan(config, self.route.as_ref(), &self.tier, body, &mut learned);
        plan.date(config, now);
        let counters =
            crate::plan::pools::counters(config, &self.tenant, &self.tier, plan.end_user.as_deref(), |name| {
                host.request_header_values(name)
            });
        match counters {
            Ok(counters) if crate::plan::pools::unnamed_end_user(config, &plan, &counters) => {
                self.plan = Some(plan);
                return Err(Verdict::Reply(decision::no_end_user(self.dialect)));
            }
            Ok(counters) => {
                crate::plan::pools::assign(config, &mut plan, &counters);
                self.recorded.pools = crate::plan::pools::claimants(config, &counters);
            }
            Err(crate::plan::pools::RepeatedHeader(header)) => {
                self.plan = Some(plan);
                return Err(Verdict::Reply(decision::repeated_pool_header(&header, self.dialect)));
            }
        }
        self.body_len = body.map_or(0, <[u8]>::len);
        let unpriced = plan.unpriced.then(|| plan.model.clone());
        let unreadable = plan.unreadable.clone().filter(|_| config.tokens.unreadable_body == UnreadableBody::Refuse);
        self.plan = Some(plan);
        if let Some(why) = unreadable {
            return Err(Verdict::Reply(decision::unreadable_body(&why, self.dialect)));
        }
        if let Some(model) = unpriced {
            return Err(Verdict::Reply(decision::model_not_priced(&model, self.dialect)));
        }
        Ok(now)
    }
}

/// What this proxy knows for one request's plan: the tenant's completion averages and the
/// calibrations as this worker last read them (with what it learned since), and the
/// counts this VM remembers.
struct ProxyKnowledge<'a, H> {
    host: &'a mut H,
    now: u64,
    config: &'a Policy,
    tenant: &'a str,
    prompt_cache: &'a mut PromptCache,
    calibrations: &'a mut VmCalibrations,
    averages: &'a mut VmAverages,
}

impl<H: Host> Learned for ProxyKnowledge<'_, H> {
    fn average(&mut self, model: &str) -> Option<OutputAverage> {
        self.averages.get(self.host, self.config, self.tenant, model)
    }

    fn calibration(&mut self, rule: usize) -> Calibration {
        self.calibrations.get(self.host, self.config, rule, self.now)
    }

    fn count(&mut self, encoding: Encoding, text: &str) -> u64 {
        self.prompt_cache.count(encoding, text)
    }
}
