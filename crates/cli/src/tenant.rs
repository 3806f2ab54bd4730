//! What `usage` and `reset` share: one counter owner and a policy's limits, named as the
//! filter names them (its config compiled by the filter's own compiler, the key or a
//! `per` header's value hashed by the filter's own function), and the call to the
//! companion. The owner is a tenant (`--key`, `--tenant`: its limits counted per tenant),
//! a header value's pool (`--per-value`: the limits counted per that header), or the pool
//! of every caller (`--all`: the limits counted per `all`, such as the upstream's quota),
//! so a reset of a key never resets a pool it shares.

use llm_ratelimit_core::api::identity::{is_tenant_id, tenant_id};
use llm_ratelimit_core::config::{Limit, Per, Policy};
use llm_ratelimit_core::plan::pools::{end_user_owner, pool_owner};
use llm_ratelimit_protocol::keys::ALL_OWNER;
use llm_ratelimit_protocol::{LimitSpec, TenantLimits, TOKEN_HEADER};
use serde::de::DeserializeOwned;
use std::path::PathBuf;
use std::time::Duration;

#[derive(clap::Args)]
#[command(group = clap::ArgGroup::new("who").required(true).args(["key", "tenant", "per_value", "all"]))]
pub struct TenantArgs {
    /// The filter's config (the JSON the proxy loads, or an Envoy, Istio or Envoy Gateway
    /// manifest holding one, as `check-config` reads them): its domain and limits.
    #[arg(long, value_name = "FILE")]
    pub config: PathBuf,
    /// The tenant's API key, hashed here as the filter hashes it (never sent). Prefer
    /// LLMRL_API_KEY: a command line is visible to other users of the machine.
    #[arg(long, env = "LLMRL_API_KEY", hide_env_values = true)]
    pub key: Option<String>,
    /// The tenant id (32 hex digits, as in the companion's logs and `bypass.tenants`).
    #[arg(long)]
    pub tenant: Option<String>,
    /// A shared pool: the value of the header the limits are counted per (`limits[].per`,
    /// a team or org id), hashed here as the filter hashes it (never sent).
    #[arg(long, value_name = "VALUE")]
    pub per_value: Option<String>,
    /// The pool of every caller: the limits counted per `all` (the upstream's quotas).
    #[arg(long)]
    pub all: bool,
    /// An end user of the key (`--key`) or tenant (`--tenant`): the limits counted per end
    /// user (`limits[].per: "end_user"`), the user hashed with the tenant as the filter does.
    #[arg(long, value_name = "NAME", conflicts_with_all = ["per_value", "all"])]
    pub user: Option<String>,
    /// Only these limits (repeat the flag); default every limit of the policy counted per
    /// what `--key`/`--tenant`, `--per-value` or `--all` names.
    #[arg(long = "limit", value_name = "NAME")]
    pub limits: Vec<String>,
    /// The companion's base URL.
    #[arg(long, env = "LLMRL_COMPANION_URL", default_value = "http://127.0.0.1:8081")]
    pub companion: String,
    /// The companion's admin credential (one of its `--admin-token` list; the filter's
    /// data-plane token is refused on admin endpoints). Prefer the environment or
    /// --admin-token-file: a command line is visible to other users of the machine.
    #[arg(long, env = "LLMRL_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// File holding the admin credential (trailing whitespace ignored).
    #[arg(long, env = "LLMRL_ADMIN_TOKEN_FILE", value_name = "FILE")]
    pub admin_token_file: Option<PathBuf>,
    /// Longest wait for the companion's answer.
    #[arg(long, default_value = "5s", value_parser = llm_ratelimit_protocol::duration::parse_duration)]
    pub timeout: Duration,
}

/// The policy, the request naming the tenant and its limits, and the token to send.
pub struct Resolved {
    pub policy: Policy,
    pub request: TenantLimits,
    token: String,
}

impl TenantArgs {
    pub fn resolve(&self) -> Result<Resolved, String> {
        let file = self.config.display();
        let text = std::fs::read_to_string(&self.config).map_err(|e| format!("cannot read {file}: {e}"))?;
        let config = crate::check_config::the_config(&text).map_err(|e| format!("{file}: {e}"))?;
        let policy = Policy::from_json(&config).map_err(|e| format!("{file}: {e}"))?;
        for name in &self.limits {
            if policy.limit(name).is_none() {
                let known: Vec<&str> = policy.limits.iter().map(|l| l.name.as_str()).collect();
                return Err(format!("the policy has no limit {name:?} (it has {})", known.join(", ")));
            }
        }
        let (tenant, limits) = self.owner_and_limits(&policy)?;
        let limits = limits.into_iter().map(spec).collect();
        let token = match (&self.admin_token, &self.admin_token_file) {
            (Some(token), None) => token.clone(),
            (None, Some(path)) => std::fs::read_to_string(path)
                .map_err(|e| format!("cannot read --admin-token-file {}: {e}", path.display()))?
                .trim_end()
                .to_string(),
            (Some(_), Some(_)) => {
                return Err("give the admin credential once: --admin-token or --admin-token-file".into())
            }
            (None, None) => {
                return Err(
                    "the companion's admin credential is required: set LLMRL_ADMIN_TOKEN or --admin-token-file \
                     (the filter's token cannot read or reset tenants)"
                        .into(),
                )
            }
        };
        let request = TenantLimits { domain: policy.domain.clone(), tenant, limits };
        Ok(Resolved { policy, request, token })
    }

    /// Whose counters are addressed, and the policy's limits counted per that (those of
    /// `--limit` only, if given).
    fn owner_and_limits<'a>(&self, policy: &'a Policy) -> Result<(String, Vec<&'a Limit>), String> {
        let chosen = |l: &&Limit| self.limits.is_empty() || self.limits.contains(&l.name);
        let of = |per: fn(&Per) -> bool| -> Vec<&Limit> {
            policy.limits.iter().filter(|l| per(&l.per)).filter(chosen).collect()
        };
        let end_user = |tenant: String| match &self.user {
            Some(user) => (end_user_owner(&tenant, user.trim()), of(|p| matches!(p, Per::EndUser { .. }))),
            None => (tenant, of(|p| *p == Per::Tenant)),
        };
        let (owner, limits) = match (&self.key, &self.tenant, &self.per_value) {
            (Some(key), _, _) => end_user(tenant_id(key.trim())),
            (None, Some(tenant), _) if is_tenant_id(tenant) => end_user(tenant.clone()),
            (None, Some(_), _) => {
                return Err(
                    "--tenant takes a tenant id (32 lower-case hex digits, or anonymous); for a key use --key".into()
                )
            }
            (None, None, Some(value)) => {
                let limits = of(|p| matches!(p, Per::Header { .. }));
                let headers: std::collections::BTreeSet<&str> = limits
                    .iter()
                    .filter_map(|l| match &l.per {
                        Per::Header { name, .. } => Some(name.as_str()),
                        _ => None,
                    })
                    .collect();
                let [header] = headers.into_iter().collect::<Vec<_>>()[..] else {
                    return Err("--per-value addresses the limits counted per one header: the policy's (or those of                                 --limit) name none or several; choose with --limit"
                        .into());
                };
                (pool_owner(header, value.trim()), limits)
            }
            (None, None, None) if self.all => (ALL_OWNER.to_string(), of(|p| *p == Per::All)),
            (None, None, None) => return Err("give --key, --tenant, --per-value or --all".into()),
        };
        if limits.is_empty() {
            return Err("no limit of the policy (or of --limit) is counted per what was named".into());
        }
        Ok((owner, limits))
    }

    /// POSTs `request` to the companion's `path` and reads its JSON answer.
    pub fn call<T: DeserializeOwned>(&self, resolved: &Resolved, path: &str) -> Result<T, String> {
        let config =
            ureq::Agent::config_builder().http_status_as_error(false).timeout_global(Some(self.timeout)).build();
        let agent = ureq::Agent::new_with_config(config);
        let url = format!("{}{path}", self.companion.trim_end_matches('/'));
        let sent = agent.post(&url).header(TOKEN_HEADER, &resolved.token).send_json(&resolved.request);
        let body = answer_body(&url, sent)?;
        serde_json::from_str(&body).map_err(|e| format!("unexpected answer from the companion: {e}"))
    }
}

/// Milliseconds since the epoch by this machine's clock: where a calendar budget's
/// period boundaries are placed (Redis's clock picks the period among them).
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |elapsed| u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX))
}

/// A limit as a charge names it, without a cost.
fn spec(limit: &Limit) -> LimitSpec {
    LimitSpec {
        name: limit.name.clone(),
        capacity: limit.capacity(),
        window_ms: limit.window_ms(),
        kind: limit.kind,
        period_bounds_ms: limit.period_bounds_ms(now_ms()),
    }
}

/// The body of the companion's answer to a call to `url`: its error in words when the call
/// failed or the status is not a success (the companion's `error` field, else the body).
pub(crate) fn answer_body(
    url: &str,
    sent: Result<ureq::http::Response<ureq::Body>, ureq::Error>,
) -> Result<String, String> {
    let mut response = sent.map_err(|e| format!("cannot reach the companion at {url}: {e}"))?;
    let status = response.status();
    let body = response.body_mut().read_to_string().map_err(|e| format!("reading the companion's answer: {e}"))?;
    if !status.is_success() {
        let message = serde_json::from_str::<serde_json::Value>(&body)
            .ok()
            .and_then(|v| v.get("error").and_then(|e| e.as_str()).map(str::to_string))
            .unwrap_or(body);
        return Err(format!("the companion answered {}: {message}", status.as_u16()));
    }
    Ok(body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use llm_ratelimit_protocol::LimitKind;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Tests run in parallel: each config file its own name.
    static FILES: AtomicUsize = AtomicUsize::new(0);

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        tenant: TenantArgs,
    }

    fn resolve(config: &str, args: &[&str]) -> Result<Resolved, String> {
        let n = FILES.fetch_add(1, Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("llmrl-cli-test-{}-{n}.json", std::process::id()));
        std::fs::write(&path, config).map_err(|e| e.to_string())?;
        let path_text = path.to_string_lossy().into_owned();
        let cli = Cli::try_parse_from(["llm-ratelimit", "--config", path_text.as_str()].iter().chain(args))
            .map_err(|e| e.to_string())?;
        let resolved = cli.tenant.resolve();
        let _ = std::fs::remove_file(&path);
        resolved
    }

    const CONFIG: &str = r#"{"companion": {"upstream": "c", "token": "secret-token-0123456789"}, "domain": "prod",
        "limits": [{"name": "rpm", "requests": 20, "window": "1m"}, {"name": "inflight", "concurrency": 3},
                   {"name": "tpm", "tokens": 1000, "window": "1h", "algorithm": "sliding_window"}]}"#;

    #[test]
    fn a_key_is_hashed_as_the_filter_hashes_it() {
        // tests/cases/keys.json pins sk-a to this tenant for the filter and the harness.
        let resolved =
            resolve(CONFIG, &["--key", "sk-a", "--admin-token", "admin-token-0123456789"]).expect("resolves");
        assert_eq!(resolved.request.tenant, "200b482a0a785564144b9f1b4f3f1104");
        assert_eq!(resolved.request.domain, "prod");
        assert_eq!(resolved.token, "admin-token-0123456789");
        // Never the config's (data-plane) token: without the admin credential, refused.
        let err = resolve(CONFIG, &["--key", "sk-a"]).err().unwrap_or_default();
        assert!(err.contains("admin credential is required") && !err.contains("secret-token-0123456789"), "{err}");
    }

    #[test]
    fn the_config_may_come_in_a_manifest() {
        // An Istio WasmPlugin, as check-config reads it: the policy is the embedded one.
        let manifest = format!(
            "apiVersion: extensions.istio.io/v1alpha1\nkind: WasmPlugin\nmetadata: {{name: llm-ratelimit}}\nspec:\n  pluginConfig: {}\n",
            CONFIG.replace('\n', " ")
        );
        let resolved = resolve(&manifest, &["--key", "sk-a", "--admin-token", "a"]).expect("resolves");
        assert_eq!(resolved.request.domain, "prod");
        let two = format!("{manifest}---\n{manifest}");
        assert!(resolve(&two, &["--key", "sk-a", "--admin-token", "a"])
            .is_err_and(|e| e.contains("2 filter configs found")));
    }

    #[test]
    fn the_limits_are_named_as_a_charge_names_them() {
        let resolved =
            resolve(CONFIG, &["--tenant", "200b482a0a785564144b9f1b4f3f1104", "--admin-token", "t2"]).expect("ok");
        let limits: Vec<(&str, u64, u64, LimitKind)> =
            resolved.request.limits.iter().map(|l| (l.name.as_str(), l.capacity, l.window_ms, l.kind)).collect();
        assert_eq!(
            limits,
            [
                ("rpm", 20, 60_000, LimitKind::TokenBucket),
                ("inflight", 3, 30_000, LimitKind::Slots),
                ("tpm", 1000, 3_600_000, LimitKind::SlidingWindow)
            ]
        );
        assert_eq!(resolved.token, "t2");
        let only = resolve(CONFIG, &["--tenant", "anonymous", "--limit", "tpm", "--admin-token", "a"]).expect("ok");
        assert_eq!(only.request.limits.len(), 1);
    }

    const POOLS: &str = r#"{"companion": {"upstream": "c", "token": "secret-token-0123456789"},
        "limits": [{"name": "key", "requests": 20, "window": "1m"},
                   {"name": "team", "requests": 200, "window": "1m", "per": {"header": "x-team-id"}},
                   {"name": "upstream", "tokens": 2000000, "window": "1m", "per": "all", "models": ["gpt-4o*"]}]}"#;

    #[test]
    fn a_key_a_team_pool_and_the_upstream_quota_are_addressed_apart() {
        let names = |r: &Resolved| r.request.limits.iter().map(|l| l.name.clone()).collect::<Vec<_>>();
        let key = resolve(POOLS, &["--key", "sk-a", "--admin-token", "a"]).expect("ok");
        assert_eq!(
            (key.request.tenant.as_str(), names(&key)),
            ("200b482a0a785564144b9f1b4f3f1104", vec!["key".into()])
        );
        let team = resolve(POOLS, &["--per-value", "team-a", "--admin-token", "a"]).expect("ok");
        assert_eq!(team.request.tenant, pool_owner("x-team-id", "team-a"));
        assert_eq!(names(&team), ["team"]);
        let all = resolve(POOLS, &["--all", "--admin-token", "a"]).expect("ok");
        assert_eq!((all.request.tenant.as_str(), names(&all)), ("all", vec!["upstream".into()]));
        let err = resolve(POOLS, &["--all", "--limit", "key", "--admin-token", "a"]).err().unwrap_or_default();
        assert!(err.contains("no limit of the policy"), "{err}");
        let err = resolve(CONFIG, &["--per-value", "t", "--admin-token", "a"]).err().unwrap_or_default();
        assert!(err.contains("counted per one header"), "{err}");
    }

    #[test]
    fn what_cannot_name_a_tenant_or_a_limit_is_refused() {
        let err = resolve(CONFIG, &["--tenant", "sk-a"]).err().unwrap_or_default();
        assert!(err.contains("--tenant takes a tenant id") && !err.contains("sk-a"), "{err}");
        let err = resolve(CONFIG, &["--key", "k", "--limit", "rpd"]).err().unwrap_or_default();
        assert!(err.contains(r#"no limit "rpd" (it has rpm, inflight, tpm)"#), "{err}");
        let err = resolve(CONFIG, &["--key", "k", "--tenant", "anonymous"]).err().unwrap_or_default();
        assert!(err.contains("cannot be used with"), "{err}");
        let err = resolve(r#"{"limits": []}"#, &["--key", "k"]).err().unwrap_or_default();
        assert!(err.contains("companion"), "{err}");
    }
}
