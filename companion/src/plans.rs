//! The admin API of plans (`llm_ratelimit_protocol::plan_admin`): set, show, delete, list,
//! import and the audit log of owners' plans, the hashes `lua/limits.lua` reads as it
//! charges (`llm_ratelimit_protocol::plans`). Admin credential only.
//!
//! A change to one plan is one call of `lua/plans.lua`: it reads the plan before, writes
//! it and returns both, atomically. Beside the plans, per domain, an index of the owners
//! that have one (a sorted set read by prefix, for listing) and the audit log (a stream
//! bounded at about `AUDIT_MAX_ENTRIES`). On one server (or behind Sentinel) the script
//! updates both with the plan, atomically. On a cluster they are in another hash slot
//! than the plan: the owner is added to the index before the plan is written and again
//! after (so an owner with a plan is never missing from it), and the change is logged
//! after the write (a companion that dies between the two leaves that change unlogged).
//! The index may name owners whose plan is gone (a `revert` plan expires by its TTL):
//! listing skips them and removes them from the index.

use crate::store::{Script, Store};
use crate::{admin_only, error, json_reply, App};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use futures_util::future::{join_all, try_join_all};
use llm_ratelimit_protocol::keys::redis_key;
use llm_ratelimit_protocol::plan_admin::{
    check_line, check_owner, plan_of_fields, AuditEntry, CheckedChange, History, ImportReply, LineError, Plan,
    PlanChange, PlanChanged, PlanPage, AUDIT_KIND, AUDIT_MAX_ENTRIES, AUDIT_NAME, INDEX_KIND, INDEX_NAME, INDEX_OWNER,
    MAX_HISTORY, MAX_IMPORT_ERRORS, MAX_IMPORT_LINES, MAX_PAGE,
};
use llm_ratelimit_protocol::plans::{PLAN_KIND, PLAN_NAME};
use llm_ratelimit_protocol::TOKEN_HEADER;
use redis::Value;
use serde_json::json;
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

pub const SOURCE: &str = include_str!("../../lua/plans.lua");

/// How many plan writes of an import are in flight at once (each its own script call,
/// pipelined on the connection; few enough that a charge waits behind little of it).
const IMPORT_IN_FLIGHT: usize = 32;
/// Audit entries read per call while looking for one owner's.
const HISTORY_CHUNK: usize = 500;

/// The admin credential's fingerprint in the audit log and a plan's `updated_by`: the
/// first 8 bytes of SHA-256 over a domain separator and the credential, as 16 hex digits
/// after `admin:`. Never the credential, and not reversible to it (the companion refuses
/// weak admin credentials); `llm-ratelimit plan whoami` prints the operator's own (its
/// own copy of this function: the CLI does not link the companion).
pub fn fingerprint(credential: &[u8]) -> String {
    let digest = Sha256::new().chain_update(b"llm-ratelimit/admin/v1\0").chain_update(credential).finalize();
    let hex: String = digest.iter().take(8).map(|b| format!("{b:02x}")).collect();
    format!("admin:{hex}")
}

fn plan_key(prefix: &str, domain: &str, owner: &str) -> String {
    redis_key(prefix, domain, owner, PLAN_KIND, PLAN_NAME)
}

fn index_key(prefix: &str, domain: &str) -> String {
    redis_key(prefix, domain, INDEX_OWNER, INDEX_KIND, INDEX_NAME)
}

fn audit_key(prefix: &str, domain: &str) -> String {
    redis_key(prefix, domain, INDEX_OWNER, AUDIT_KIND, AUDIT_NAME)
}

/// Why a plan operation failed: the request (400) or Redis (503).
#[derive(Debug)]
enum Failure {
    Bad(String),
    Redis(String),
}

impl Failure {
    fn response(self) -> Response {
        match self {
            Failure::Bad(message) => error(StatusCode::BAD_REQUEST, message),
            Failure::Redis(message) => error(StatusCode::SERVICE_UNAVAILABLE, message),
        }
    }
}

fn redis_failure(err: redis::RedisError) -> Failure {
    Failure::Redis(format!("redis: {err}"))
}

fn text(value: &Value) -> Option<String> {
    match value {
        Value::BulkString(bytes) => Some(String::from_utf8_lossy(bytes).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        Value::Int(n) => Some(n.to_string()),
        _ => None,
    }
}

/// A hash's fields as HGETALL (or a stream entry's) gives them: a flat list, or a map.
fn pairs(value: &Value) -> Vec<(String, String)> {
    match value {
        Value::Array(items) => items
            .chunks(2)
            .filter_map(|pair| match pair {
                [field, value] => Some((text(field)?, text(value)?)),
                _ => None,
            })
            .collect(),
        Value::Map(items) => items.iter().filter_map(|(f, v)| Some((text(f)?, text(v)?))).collect(),
        _ => Vec::new(),
    }
}

/// A plan as the script encodes it (a JSON object of its fields, `{}` for none).
fn plan_of_json(owner: &str, encoded: &str) -> Result<Option<Plan>, String> {
    let fields: BTreeMap<String, String> =
        serde_json::from_str(encoded).map_err(|e| format!("unexpected plan from the script: {e}"))?;
    plan_of_fields(owner, fields.iter().map(|(k, v)| (k.as_str(), v.as_str())))
}

/// Redis's clock, in ms since the epoch.
async fn redis_now_ms(store: &Store) -> Result<u64, Failure> {
    let value = store.query(&redis::cmd("TIME")).await.map_err(redis_failure)?;
    let parts: Vec<u64> = match &value {
        Value::Array(items) => items.iter().filter_map(|v| text(v)?.parse().ok()).collect(),
        _ => Vec::new(),
    };
    match parts[..] {
        [seconds, micros] => Ok(seconds * 1000 + micros / 1000),
        _ => Err(Failure::Redis(format!("unexpected TIME reply {value:?}"))),
    }
}

/// Where the plans of a domain are, and who is changing them.
struct Plans<'a> {
    store: &'a Store,
    script: &'a Script,
    prefix: &'a str,
    domain: &'a str,
}

impl Plans<'_> {
    fn index(&self) -> String {
        index_key(self.prefix, self.domain)
    }

    /// The script's keys: the plan's, and on one server the index's and the log's.
    fn keys(&self, owner: &str) -> Vec<String> {
        let mut keys = vec![plan_key(self.prefix, self.domain, owner)];
        if !self.store.is_cluster() {
            keys.extend([self.index(), audit_key(self.prefix, self.domain)]);
        }
        keys
    }

    /// On a cluster: the owner into the index (idempotent).
    async fn indexed(&self, owner: &str) -> Result<(), Failure> {
        self.store.query(redis::cmd("ZADD").arg(self.index()).arg(0).arg(owner)).await.map_err(redis_failure)?;
        Ok(())
    }

    /// On a cluster: the change into the log, after the script.
    async fn log(&self, owner: &str, op: &str, by: &str, before: &str, after: &str) -> Result<(), Failure> {
        let mut xadd = redis::cmd("XADD");
        xadd.arg(audit_key(self.prefix, self.domain)).arg("MAXLEN").arg("~").arg(AUDIT_MAX_ENTRIES).arg("*");
        xadd.arg("owner").arg(owner).arg("op").arg(op).arg("by").arg(by).arg("before").arg(before);
        xadd.arg("after").arg(after);
        self.store.query(&xadd).await.map_err(redis_failure)?;
        Ok(())
    }

    fn call(owner: &str, op: &str, by: &str) -> serde_json::Map<String, serde_json::Value> {
        let mut call = serde_json::Map::new();
        call.insert("owner".into(), owner.into());
        call.insert("op".into(), op.into());
        call.insert("by".into(), by.into());
        call.insert("audit_max".into(), AUDIT_MAX_ENTRIES.to_string().into());
        call
    }

    /// Applies a checked change to `owner`'s plan, logged as `op`.
    async fn set(&self, owner: &str, change: &CheckedChange, op: &str, by: &str) -> Result<PlanChanged, Failure> {
        let mut call = Plans::call(owner, op, by);
        // Numbers as strings: the script writes them as given.
        let caps: serde_json::Map<String, serde_json::Value> =
            change.caps.iter().map(|(name, cap)| (name.clone(), cap.to_string().into())).collect();
        call.insert("replace".into(), change.replace.into());
        call.insert("caps".into(), caps.into());
        call.insert("clear".into(), change.clear.clone().into());
        call.insert("unsuspend".into(), change.unsuspend.into());
        call.insert("no_expiry".into(), change.no_expiry.into());
        for (field, value) in [
            ("suspend", change.suspend.clone()),
            ("expires_ms", change.expires_ms.map(|ms| ms.to_string())),
            ("at_expiry", change.at_expiry.clone()),
            ("note", change.note.clone()),
        ] {
            if let Some(value) = value {
                call.insert(field.into(), value.into());
            }
        }
        let cluster = self.store.is_cluster();
        if cluster {
            self.indexed(owner).await?;
        }
        let args = serde_json::Value::Object(call).to_string();
        let value = self.store.run(self.script, &self.keys(owner), &["set", &args]).await.map_err(redis_failure)?;
        let (before, after) = match &value {
            Value::Array(items) => match &items[..] {
                [Value::Int(1), before, after] => (text(before).unwrap_or_default(), text(after).unwrap_or_default()),
                [Value::Int(0), message] => return Err(Failure::Bad(text(message).unwrap_or_default())),
                _ => return Err(Failure::Redis(format!("unexpected script reply {value:?}"))),
            },
            _ => return Err(Failure::Redis(format!("unexpected script reply {value:?}"))),
        };
        if cluster {
            if after != "{}" {
                self.indexed(owner).await?;
            }
            self.log(owner, op, by, &before, &after).await?;
        }
        Ok(PlanChanged {
            owner: owner.to_string(),
            before: plan_of_json(owner, &before).map_err(Failure::Redis)?,
            after: plan_of_json(owner, &after).map_err(Failure::Redis)?,
        })
    }

    /// Deletes `owner`'s plan; `None` if it had none.
    async fn delete(&self, owner: &str, by: &str) -> Result<Option<PlanChanged>, Failure> {
        let args = serde_json::Value::Object(Plans::call(owner, "delete", by)).to_string();
        let value = self.store.run(self.script, &self.keys(owner), &["delete", &args]).await.map_err(redis_failure)?;
        let before = match &value {
            Value::Array(items) => match &items[..] {
                [Value::Int(1), before, _] => text(before).unwrap_or_default(),
                [Value::Int(2)] => return Ok(None),
                _ => return Err(Failure::Redis(format!("unexpected script reply {value:?}"))),
            },
            _ => return Err(Failure::Redis(format!("unexpected script reply {value:?}"))),
        };
        if self.store.is_cluster() {
            self.log(owner, "delete", by, &before, "{}").await?;
            self.prune(&[owner.to_string()]).await?;
        }
        Ok(Some(PlanChanged {
            owner: owner.to_string(),
            before: plan_of_json(owner, &before).map_err(Failure::Redis)?,
            after: None,
        }))
    }

    async fn show(&self, owner: &str) -> Result<Option<Plan>, Failure> {
        let value = self
            .store
            .query(redis::cmd("HGETALL").arg(plan_key(self.prefix, self.domain, owner)))
            .await
            .map_err(redis_failure)?;
        let fields = pairs(&value);
        plan_of_fields(owner, fields.iter().map(|(k, v)| (k.as_str(), v.as_str()))).map_err(Failure::Redis)
    }

    /// Removes from the index the owners whose plan is gone. On one server one script
    /// call checks and removes atomically; on a cluster each is removed, then its plan
    /// checked again and the owner put back if a plan appeared meanwhile (a set adds its
    /// owner to the index after writing the plan, so no owner with a plan stays out).
    async fn prune(&self, owners: &[String]) -> Result<(), Failure> {
        if owners.is_empty() {
            return Ok(());
        }
        if !self.store.is_cluster() {
            let mut keys = vec![self.index()];
            keys.extend(owners.iter().map(|owner| plan_key(self.prefix, self.domain, owner)));
            let args = serde_json::to_string(owners).map_err(|e| Failure::Redis(e.to_string()))?;
            self.store.run(self.script, &keys, &["prune", &args]).await.map_err(redis_failure)?;
            return Ok(());
        }
        for owner in owners {
            self.store.query(redis::cmd("ZREM").arg(self.index()).arg(owner)).await.map_err(redis_failure)?;
            if self.show(owner).await?.is_some() {
                self.indexed(owner).await?;
            }
        }
        Ok(())
    }

    /// A page of plans: owners starting with `prefix`, after `after`, at most `limit`
    /// index entries read (fewer plans when some were gone).
    async fn page(&self, prefix: &str, after: Option<&str>, limit: usize) -> Result<PlanPage, Failure> {
        let low = match after {
            Some(after) if after >= prefix => format!("({after}"),
            _ => format!("[{prefix}"),
        };
        // Owner ids are [0-9a-z]: '~' sorts after every one of them.
        let high = if prefix.is_empty() { "+".to_string() } else { format!("[{prefix}~") };
        let value = self
            .store
            .query(redis::cmd("ZRANGEBYLEX").arg(self.index()).arg(&low).arg(&high).arg("LIMIT").arg(0).arg(limit))
            .await
            .map_err(redis_failure)?;
        let owners: Vec<String> = match &value {
            Value::Array(items) => items.iter().filter_map(text).collect(),
            _ => return Err(Failure::Redis(format!("unexpected ZRANGEBYLEX reply {value:?}"))),
        };
        let found = try_join_all(owners.iter().map(|owner| self.show(owner))).await?;
        let gone: Vec<String> =
            owners.iter().zip(&found).filter(|(_, plan)| plan.is_none()).map(|(o, _)| o.clone()).collect();
        self.prune(&gone).await?;
        let next = if owners.len() == limit { owners.last().cloned() } else { None };
        Ok(PlanPage { plans: found.into_iter().flatten().collect(), next })
    }

    /// The audit log, newest first: every owner's, or `owner`'s only.
    async fn history(&self, owner: Option<&str>, limit: usize) -> Result<History, Failure> {
        let key = audit_key(self.prefix, self.domain);
        let mut entries = Vec::new();
        let mut high = "+".to_string();
        let mut read = 0u64;
        while entries.len() < limit && read < 2 * AUDIT_MAX_ENTRIES {
            let count = if owner.is_some() { HISTORY_CHUNK } else { limit - entries.len() };
            let value = self
                .store
                .query(redis::cmd("XREVRANGE").arg(&key).arg(&high).arg("-").arg("COUNT").arg(count))
                .await
                .map_err(redis_failure)?;
            let Value::Array(items) = &value else {
                return Err(Failure::Redis(format!("unexpected XREVRANGE reply {value:?}")));
            };
            for item in items {
                let Value::Array(parts) = item else { continue };
                let [id, fields] = &parts[..] else { continue };
                let Some(id) = text(id) else { continue };
                high = format!("({id}");
                read += 1;
                let fields: HashMap<String, String> = pairs(fields).into_iter().collect();
                let field = |name: &str| fields.get(name).cloned().unwrap_or_default();
                let who = field("owner");
                if owner.is_some_and(|o| o != who) || entries.len() >= limit {
                    continue;
                }
                let at_ms = id.split('-').next().and_then(|ms| ms.parse().ok()).unwrap_or(0);
                entries.push(AuditEntry {
                    at_ms,
                    op: field("op"),
                    by: field("by"),
                    before: plan_of_json(&who, &field("before")).map_err(Failure::Redis)?,
                    after: plan_of_json(&who, &field("after")).map_err(Failure::Redis)?,
                    owner: who,
                    id,
                });
            }
            if items.len() < count {
                break;
            }
        }
        Ok(History { entries })
    }
}

/// A query's parameters (`a=1&b=2`; values are owner ids, domains, numbers: nothing to
/// decode but `%2C`).
fn params(uri: &Uri) -> HashMap<String, String> {
    uri.query()
        .unwrap_or("")
        .split('&')
        .filter_map(|pair| pair.split_once('='))
        .map(|(k, v)| (k.to_string(), v.replace("%2C", ",").replace("%2c", ",")))
        .collect()
}

fn number(params: &HashMap<String, String>, name: &str, default: usize, max: usize) -> Result<usize, Box<Response>> {
    match params.get(name) {
        None => Ok(default),
        Some(text) => match text.parse::<usize>() {
            Ok(n) if (1..=max).contains(&n) => Ok(n),
            _ => {
                Err(Box::new(error(StatusCode::BAD_REQUEST, format!("{name}: {text:?} is not a number in 1..={max}"))))
            }
        },
    }
}

/// The admin check, the domain and the owner of a call: `Ok((domain, owner))`.
fn domain_and_owner(
    app: &App,
    headers: &HeaderMap,
    params: &HashMap<String, String>,
    owner_required: bool,
) -> Result<(String, Option<String>), Box<Response>> {
    admin_only(app, headers)?;
    let domain = params.get("domain").cloned().unwrap_or_else(|| "llm".to_string());
    let owner = params.get("owner").cloned();
    match &owner {
        Some(owner) => check_owner(&domain, owner),
        None if owner_required => Err("owner: required".to_string()),
        None => check_owner(&domain, "all"),
    }
    .map_err(|message| Box::new(error(StatusCode::BAD_REQUEST, message)))?;
    Ok((domain, owner))
}

/// Who is calling, for the log: the fingerprint of the admin credential sent.
fn caller(headers: &HeaderMap) -> String {
    fingerprint(headers.get(TOKEN_HEADER).map(|v| v.as_bytes()).unwrap_or_default())
}

fn plans<'a>(app: &'a App, domain: &'a str) -> Plans<'a> {
    Plans { store: app.batcher.store(), script: &app.plans, prefix: &app.key_prefix, domain }
}

/// `POST PLAN_PATH`: set (create or change) one owner's plan.
pub async fn run_set(State(app): State<Arc<App>>, headers: HeaderMap, body: Bytes) -> Response {
    if let Err(response) = admin_only(&app, &headers) {
        return *response;
    }
    let change: PlanChange = match serde_json::from_slice(&body) {
        Ok(change) => change,
        Err(err) => return error(StatusCode::BAD_REQUEST, format!("invalid request body: {err}")),
    };
    let store = app.batcher.store();
    let now_ms = match redis_now_ms(store).await {
        Ok(now) => now,
        Err(failure) => return failure.response(),
    };
    let checked = match change.check(now_ms) {
        Ok(checked) => checked,
        Err(message) => return error(StatusCode::BAD_REQUEST, format!("invalid request: {message}")),
    };
    let by = caller(&headers);
    match plans(&app, &change.domain).set(&change.owner, &checked, "set", &by).await {
        Ok(changed) => {
            app.metrics.plan_changes.inc();
            eprintln!("companion: {by} set the plan of {} in domain {}", change.owner, change.domain);
            json_reply(changed)
        }
        Err(failure) => failure.response(),
    }
}

/// `GET PLAN_PATH?domain=&owner=`: one owner's plan.
pub async fn run_show(State(app): State<Arc<App>>, headers: HeaderMap, uri: Uri) -> Response {
    let (domain, owner) = match domain_and_owner(&app, &headers, &params(&uri), true) {
        Ok((domain, Some(owner))) => (domain, owner),
        Ok(_) => return error(StatusCode::BAD_REQUEST, "owner: required"),
        Err(response) => return *response,
    };
    match plans(&app, &domain).show(&owner).await {
        Ok(Some(plan)) => json_reply(plan),
        Ok(None) => error(StatusCode::NOT_FOUND, format!("{owner} has no plan in domain {domain}")),
        Err(failure) => failure.response(),
    }
}

/// `DELETE PLAN_PATH?domain=&owner=`: the owner's plan removed (the config's limits apply).
pub async fn run_delete(State(app): State<Arc<App>>, headers: HeaderMap, uri: Uri) -> Response {
    let (domain, owner) = match domain_and_owner(&app, &headers, &params(&uri), true) {
        Ok((domain, Some(owner))) => (domain, owner),
        Ok(_) => return error(StatusCode::BAD_REQUEST, "owner: required"),
        Err(response) => return *response,
    };
    let by = caller(&headers);
    match plans(&app, &domain).delete(&owner, &by).await {
        Ok(Some(changed)) => {
            app.metrics.plan_changes.inc();
            eprintln!("companion: {by} deleted the plan of {owner} in domain {domain}");
            json_reply(changed)
        }
        Ok(None) => error(StatusCode::NOT_FOUND, format!("{owner} has no plan in domain {domain}")),
        Err(failure) => failure.response(),
    }
}

/// `GET PLANS_PATH?domain=&prefix=&after=&limit=`: a page of plans in owner-id order.
pub async fn run_list(State(app): State<Arc<App>>, headers: HeaderMap, uri: Uri) -> Response {
    let params = params(&uri);
    let domain = match domain_and_owner(&app, &headers, &params, false) {
        Ok((domain, _)) => domain,
        Err(response) => return *response,
    };
    let prefix = params.get("prefix").cloned().unwrap_or_default();
    let owner_text = |s: &str| s.len() <= 40 && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
    if !owner_text(&prefix) {
        return error(StatusCode::BAD_REQUEST, "prefix: the start of an owner id (0-9, a-z)");
    }
    let after = params.get("after").filter(|a| !a.is_empty());
    if after.is_some_and(|a| !owner_text(a)) {
        return error(StatusCode::BAD_REQUEST, "after: an owner id (the `next` of the page before)");
    }
    let limit = match number(&params, "limit", 100, MAX_PAGE) {
        Ok(limit) => limit,
        Err(response) => return *response,
    };
    match plans(&app, &domain).page(&prefix, after.map(String::as_str), limit).await {
        Ok(page) => json_reply(page),
        Err(failure) => failure.response(),
    }
}

/// `GET HISTORY_PATH?domain=&owner=&limit=`: the audit log, newest first.
pub async fn run_history(State(app): State<Arc<App>>, headers: HeaderMap, uri: Uri) -> Response {
    let params = params(&uri);
    let (domain, owner) = match domain_and_owner(&app, &headers, &params, false) {
        Ok(found) => found,
        Err(response) => return *response,
    };
    let limit = match number(&params, "limit", 20, MAX_HISTORY) {
        Ok(limit) => limit,
        Err(response) => return *response,
    };
    match plans(&app, &domain).history(owner.as_deref(), limit).await {
        Ok(history) => json_reply(history),
        Err(failure) => failure.response(),
    }
}

/// `POST IMPORT_PATH?domain=&dry_run=&first_line=`: JSON lines, each replacing its owner's
/// plan. Every line is checked first; if any is bad nothing is written (400, each bad line
/// named). A Redis failure while writing leaves the lines before it written: an import is
/// idempotent, so run it again.
pub async fn run_import(State(app): State<Arc<App>>, headers: HeaderMap, uri: Uri, body: Bytes) -> Response {
    let params = params(&uri);
    let domain = match domain_and_owner(&app, &headers, &params, false) {
        Ok((domain, _)) => domain,
        Err(response) => return *response,
    };
    let dry_run = params.get("dry_run").is_some_and(|v| v == "true" || v == "1");
    let first_line = match number(&params, "first_line", 1, usize::MAX / 2) {
        Ok(n) => n,
        Err(response) => return *response,
    };
    let Ok(text) = std::str::from_utf8(&body) else {
        return error(StatusCode::BAD_REQUEST, "the body is not UTF-8 text");
    };
    let now_ms = match redis_now_ms(app.batcher.store()).await {
        Ok(now) => now,
        Err(failure) => return failure.response(),
    };
    let mut good: Vec<(String, CheckedChange)> = Vec::new();
    let mut errors = Vec::new();
    let mut bad_lines = 0;
    let mut seen: HashMap<String, usize> = HashMap::new();
    let lines = text.lines().enumerate().filter(|(_, line)| !line.trim().is_empty());
    for (n, line) in lines {
        let number = first_line + n;
        let checked =
            check_line(line, &domain, now_ms).and_then(|(owner, change)| match seen.insert(owner.clone(), number) {
                Some(earlier) => Err(format!("owner {owner} is on line {earlier} too")),
                None => Ok((owner, change)),
            });
        match checked {
            Ok(found) => good.push(found),
            Err(message) => {
                bad_lines += 1;
                if errors.len() < MAX_IMPORT_ERRORS {
                    errors.push(LineError { line: number, error: message });
                }
            }
        }
    }
    if good.len() + bad_lines > MAX_IMPORT_LINES {
        return error(StatusCode::BAD_REQUEST, format!("at most {MAX_IMPORT_LINES} lines in one call"));
    }
    let checked = good.len();
    if bad_lines > 0 {
        let reply = ImportReply { written: 0, checked, errors, bad_lines };
        let body = json!({"error": format!("{bad_lines} bad line(s): nothing written"), "import": reply});
        return (StatusCode::BAD_REQUEST, [("content-type", "application/json")], body.to_string()).into_response();
    }
    if dry_run {
        return json_reply(ImportReply { written: 0, checked, errors, bad_lines });
    }
    let by = caller(&headers);
    let plans = plans(&app, &domain);
    let mut written = 0;
    for chunk in good.chunks(IMPORT_IN_FLIGHT) {
        let results = join_all(chunk.iter().map(|(owner, change)| plans.set(owner, change, "import", &by))).await;
        for result in results {
            match result {
                Ok(_) => written += 1,
                Err(Failure::Bad(message) | Failure::Redis(message)) => {
                    app.metrics.plan_changes.inc_by(written as u64);
                    let message = format!("{message}: {written} of {checked} plans written; import again to finish");
                    return error(StatusCode::SERVICE_UNAVAILABLE, message);
                }
            }
        }
    }
    app.metrics.plan_changes.inc_by(written as u64);
    eprintln!("companion: {by} imported {written} plans in domain {domain}");
    json_reply(ImportReply { written, checked, errors, bad_lines })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fingerprint_is_short_stable_and_not_the_credential() {
        // The CLI's `plan whoami` computes the same (crates/cli/src/plan.rs pins it too).
        let print = fingerprint(b"admin-credential-0123456789");
        assert_eq!(print, "admin:ccb039607a765b0f");
        assert_ne!(print, fingerprint(b"admin-credential-0123456780"));
    }

    #[test]
    fn keys_are_the_contracts() {
        assert_eq!(plan_key("llmrl:", "llm", "all"), "llmrl:{llm:all}:plan:limits");
        assert_eq!(index_key("llmrl:", "llm"), "llmrl:{llm:plans}:plan-index:owners");
        assert_eq!(audit_key("llmrl:", "llm"), "llmrl:{llm:plans}:plan-audit:log");
    }
}
