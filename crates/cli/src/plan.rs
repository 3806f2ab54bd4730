//! `llm-ratelimit plan`: owners' plans at runtime through the companion's admin API (see
//! `llm_ratelimit_protocol::plan_admin`): set, show, delete, list, import, export and the
//! audit log. The owner is named as `usage` and `reset` name it (a key hashed here, never
//! sent; a tenant id; a team's header value, hashed; every caller) or an end user of a key
//! (`--user` with `--key` or `--tenant`), or by its owner id. Limit names and capacities
//! are checked against the filter's config (`--config`): a name the config does not have
//! is refused, never ignored, and a capacity is given in the config's unit (a `usd`
//! limit's in dollars; the companion keeps micro-dollars).

use llm_ratelimit_core::api::identity::{is_tenant_id, tenant_id};
use llm_ratelimit_core::config::{Limit, Measure, Per, Policy};
use llm_ratelimit_core::plan::pools::{end_user_owner, pool_owner};
use llm_ratelimit_protocol::keys::ALL_OWNER;
use llm_ratelimit_protocol::plan_admin::{
    check_line, History, ImportReply, Plan, PlanChange, PlanChanged, PlanPage, HISTORY_PATH, IMPORT_PATH,
    MAX_IMPORT_LINES, PLANS_PATH, PLAN_PATH,
};
use llm_ratelimit_protocol::plans::{is_owner_id, END_USER_OWNER_PREFIX, MAX_PLAN_CAPACITY};
use llm_ratelimit_protocol::TOKEN_HEADER;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

#[derive(clap::Subcommand)]
pub enum Command {
    /// Create or change an owner's plan: `tpm=2000000 monthly-usd=500`, --suspend, --expires.
    Set(SetArgs),
    /// An owner's plan.
    Show(OwnerArgs),
    /// Delete an owner's plan: the config's limits apply again.
    Delete(OwnerArgs),
    /// The plans of a domain, by owner-id prefix, a page at a time.
    List(ListArgs),
    /// Plans from JSON lines (one plan a line, as `export` writes them), each replacing its
    /// owner's; every line checked first, nothing written if any is bad.
    Import(ImportArgs),
    /// Every plan of a domain as JSON lines (what `import` reads).
    Export(ExportArgs),
    /// The audit log of plan changes, newest first: one owner's, or every owner's.
    History(HistoryArgs),
    /// The fingerprint of your admin credential, as the audit log names you.
    Whoami(Connection),
}

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    command: Command,
}

/// How to reach the companion.
#[derive(clap::Args)]
pub struct Connection {
    /// The companion's base URL.
    #[arg(long, env = "LLMRL_COMPANION_URL", default_value = "http://127.0.0.1:8081")]
    companion: String,
    /// The companion's admin credential (the filter's data-plane token is refused). Prefer
    /// LLMRL_ADMIN_TOKEN or --admin-token-file: a command line is visible to other users.
    #[arg(long, env = "LLMRL_ADMIN_TOKEN", hide_env_values = true)]
    admin_token: Option<String>,
    /// File holding the admin credential (trailing whitespace ignored).
    #[arg(long, env = "LLMRL_ADMIN_TOKEN_FILE", value_name = "FILE")]
    admin_token_file: Option<PathBuf>,
    /// Longest wait for one answer of the companion.
    #[arg(long, default_value = "60s", value_parser = llm_ratelimit_protocol::duration::parse_duration)]
    timeout: Duration,
}

/// Where: the config (its domain; required where limits are named) or just a domain.
#[derive(clap::Args)]
pub struct Where {
    /// The filter's config (JSON, or a manifest holding it, as `check-config` reads them):
    /// its domain, and the limits a plan may name.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// The filter's `domain`, when no --config is given.
    #[arg(long, conflicts_with = "config")]
    domain: Option<String>,
}

/// Whose plan.
#[derive(clap::Args)]
#[command(group = clap::ArgGroup::new("who").args(["key", "tenant", "per_value", "all", "owner"]))]
pub struct Who {
    /// The tenant's API key, hashed here as the filter hashes it (never sent). Prefer
    /// LLMRL_API_KEY.
    #[arg(long, env = "LLMRL_API_KEY", hide_env_values = true)]
    key: Option<String>,
    /// The tenant id (32 hex digits).
    #[arg(long)]
    tenant: Option<String>,
    /// A team's (or org's) pool: the value of the header its limits are counted per,
    /// hashed here as the filter hashes it.
    #[arg(long, value_name = "VALUE")]
    per_value: Option<String>,
    /// With --per-value: the header (default: the one the config's limits are counted per).
    #[arg(long, requires = "per_value")]
    header: Option<String>,
    /// The pool of every caller (limits counted per `all`).
    #[arg(long)]
    all: bool,
    /// An end user of the key or tenant given (a shared key's user), hashed with it.
    #[arg(long, value_name = "NAME")]
    user: Option<String>,
    /// An owner id as the companion names it (from `list`, `history` or the logs).
    #[arg(long)]
    owner: Option<String>,
}

#[derive(clap::Args)]
pub struct OwnerArgs {
    #[command(flatten)]
    who: Who,
    #[command(flatten)]
    place: Where,
    #[command(flatten)]
    connection: Connection,
}

#[derive(clap::Args)]
pub struct SetArgs {
    /// Capacities, `NAME=AMOUNT` in the config's unit: requests, tokens, slots, dollars for
    /// a `usd` limit. 0 refuses every request the limit applies to.
    #[arg(value_name = "NAME=AMOUNT")]
    capacities: Vec<String>,
    #[command(flatten)]
    who: Who,
    /// The filter's config: the limits named must be its own, counted per this owner.
    #[arg(long, value_name = "FILE")]
    config: PathBuf,
    /// Remove a limit's override (repeat the flag): the config's capacity applies again.
    #[arg(long, value_name = "NAME")]
    clear: Vec<String>,
    /// Suspend the owner: every request refused (403), this reason in the message.
    #[arg(long, value_name = "REASON", conflicts_with = "unsuspend")]
    suspend: Option<String>,
    /// Lift a suspension.
    #[arg(long)]
    unsuspend: bool,
    /// When the plan ends: an RFC 3339 instant (2027-01-01T00:00:00Z) or a date (its UTC
    /// midnight).
    #[arg(long, value_name = "WHEN")]
    expires: Option<String>,
    /// What follows the end: `revert` (the config's limits; the default) or `suspend`.
    #[arg(long, value_parser = ["revert", "suspend"])]
    at_expiry: Option<String>,
    /// Remove the plan's end.
    #[arg(long, conflicts_with_all = ["expires", "at_expiry"])]
    no_expiry: bool,
    /// A note for operators ("" removes it).
    #[arg(long)]
    note: Option<String>,
    /// The plan becomes exactly what this command says (else it is merged into the plan).
    #[arg(long)]
    replace: bool,
    #[command(flatten)]
    connection: Connection,
}

#[derive(clap::Args)]
pub struct ListArgs {
    /// Only owners whose id starts with this.
    #[arg(long, default_value = "")]
    prefix: String,
    /// Start after this owner id (the `next` a page printed).
    #[arg(long)]
    after: Option<String>,
    /// Plans per page.
    #[arg(long, default_value_t = 100)]
    limit: usize,
    #[command(flatten)]
    place: Where,
    #[command(flatten)]
    connection: Connection,
}

#[derive(clap::Args)]
pub struct ImportArgs {
    /// The JSON lines file (`-`: standard input).
    file: PathBuf,
    /// The filter's config: every line's limits must be its own, counted per the line's owner.
    #[arg(long, value_name = "FILE")]
    config: PathBuf,
    /// Check every line (here and by the companion), write nothing.
    #[arg(long)]
    dry_run: bool,
    #[command(flatten)]
    connection: Connection,
}

#[derive(clap::Args)]
pub struct ExportArgs {
    /// Only owners whose id starts with this.
    #[arg(long, default_value = "")]
    prefix: String,
    /// Write here rather than to standard output.
    #[arg(long, short)]
    output: Option<PathBuf>,
    #[command(flatten)]
    place: Where,
    #[command(flatten)]
    connection: Connection,
}

#[derive(clap::Args)]
pub struct HistoryArgs {
    #[command(flatten)]
    who: Who,
    /// Most entries.
    #[arg(long, default_value_t = 20)]
    limit: usize,
    #[command(flatten)]
    place: Where,
    #[command(flatten)]
    connection: Connection,
}

pub fn run(args: &Args) -> Result<(), String> {
    match &args.command {
        Command::Set(args) => set(args),
        Command::Show(args) => {
            let plan: Plan = parse(&args.call("GET")?)?;
            println!("{}", serde_json::to_string(&plan).map_err(|e| e.to_string())?);
            Ok(())
        }
        Command::Delete(args) => {
            let changed: PlanChanged = parse(&args.call("DELETE")?)?;
            eprintln!("deleted the plan of {}", changed.owner);
            println!("{}", serde_json::to_string(&changed).map_err(|e| e.to_string())?);
            Ok(())
        }
        Command::List(args) => {
            let (domain, _) = args.place.resolve()?;
            let after = args.after.as_deref().map(|a| format!("&after={a}")).unwrap_or_default();
            let path = format!("{PLANS_PATH}?domain={domain}&prefix={}&limit={}{after}", args.prefix, args.limit);
            let page: PlanPage = parse(&args.connection.call("GET", &path, None)?)?;
            for plan in &page.plans {
                println!("{}", serde_json::to_string(plan).map_err(|e| e.to_string())?);
            }
            match &page.next {
                Some(next) => eprintln!("more: --after {next}"),
                None => eprintln!("(end)"),
            }
            Ok(())
        }
        Command::Import(args) => import(args),
        Command::Export(args) => export(args),
        Command::History(args) => {
            let (domain, policy) = args.place.resolve()?;
            let owner = args.who.owner(policy.as_ref())?.map(|o| format!("&owner={}", o.id)).unwrap_or_default();
            let path = format!("{HISTORY_PATH}?domain={domain}&limit={}{owner}", args.limit);
            let history: History = parse(&args.connection.call("GET", &path, None)?)?;
            for entry in &history.entries {
                println!("{}", serde_json::to_string(entry).map_err(|e| e.to_string())?);
            }
            Ok(())
        }
        Command::Whoami(connection) => {
            println!("{}", fingerprint(connection.token()?.as_bytes()));
            Ok(())
        }
    }
}

impl OwnerArgs {
    /// `method` on the plan of the owner named.
    fn call(&self, method: &str) -> Result<String, String> {
        let (domain, policy) = self.place.resolve()?;
        let owner = self
            .who
            .owner(policy.as_ref())?
            .ok_or("name the owner: --key, --tenant, --per-value, --all, --user or --owner")?;
        self.connection.call(method, &format!("{PLAN_PATH}?domain={domain}&owner={}", owner.id), None)
    }
}

/// As the companion fingerprints an admin credential (companion/src/plans.rs; both tests
/// pin the same value).
fn fingerprint(credential: &[u8]) -> String {
    let digest = Sha256::new().chain_update(b"llm-ratelimit/admin/v1\0").chain_update(credential).finalize();
    let hex: String = digest.iter().take(8).map(|b| format!("{b:02x}")).collect();
    format!("admin:{hex}")
}

fn parse<T: serde::de::DeserializeOwned>(body: &str) -> Result<T, String> {
    serde_json::from_str(body).map_err(|e| format!("unexpected answer from the companion: {e}"))
}

fn policy_of(path: &PathBuf) -> Result<Policy, String> {
    let file = path.display();
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {file}: {e}"))?;
    let config = crate::check_config::the_config(&text).map_err(|e| format!("{file}: {e}"))?;
    Policy::from_json(&config).map_err(|e| format!("{file}: {e}"))
}

impl Where {
    fn resolve(&self) -> Result<(String, Option<Policy>), String> {
        match (&self.config, &self.domain) {
            (Some(path), _) => {
                let policy = policy_of(path)?;
                Ok((policy.domain.clone(), Some(policy)))
            }
            (None, Some(domain)) if llm_ratelimit_protocol::is_key_part(domain) => Ok((domain.clone(), None)),
            (None, Some(_)) => Err("--domain must be 1-64 of [A-Za-z0-9_.-]".into()),
            (None, None) => Err("give the filter's --config (or its --domain)".into()),
        }
    }
}

/// What an owner is, for which limits a plan of it may name.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Kind {
    Tenant,
    /// A pool of a header's values: the header when known.
    Pool(Option<String>),
    All,
    EndUser,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Owner {
    id: String,
    kind: Kind,
}

impl Kind {
    /// The kind of an owner id.
    fn of_id(id: &str) -> Kind {
        if id == ALL_OWNER {
            Kind::All
        } else if id.starts_with(llm_ratelimit_protocol::keys::POOL_OWNER_PREFIX) {
            Kind::Pool(None)
        } else if id.starts_with(END_USER_OWNER_PREFIX) {
            Kind::EndUser
        } else {
            Kind::Tenant
        }
    }

    /// Whether `limit` is counted per owners of this kind.
    fn counts(&self, limit: &Limit) -> bool {
        match (&limit.per, self) {
            (Per::Tenant, Kind::Tenant) | (Per::All, Kind::All) | (Per::EndUser { .. }, Kind::EndUser) => true,
            (Per::Header { name, .. }, Kind::Pool(header)) => header.as_ref().is_none_or(|h| h == name),
            _ => false,
        }
    }

    fn describe(&self) -> String {
        match self {
            Kind::Tenant => "a tenant".into(),
            Kind::Pool(Some(header)) => format!("a pool of {header:?} values"),
            Kind::Pool(None) => "a pool of a header's values".into(),
            Kind::All => "every caller's pool (all)".into(),
            Kind::EndUser => "an end user".into(),
        }
    }
}

fn per_text(per: &Per) -> String {
    match per {
        Per::Tenant => "per tenant".into(),
        Per::All => "per all".into(),
        Per::Header { name, .. } => format!("per the header {name:?}"),
        Per::EndUser { .. } => "per end user".into(),
    }
}

impl Who {
    /// The owner named, if any. `policy` tells a `--per-value`'s header when not given.
    fn owner(&self, policy: Option<&Policy>) -> Result<Option<Owner>, String> {
        let tenant = match (&self.key, &self.tenant) {
            (Some(key), _) => Some(tenant_id(key.trim())),
            (None, Some(tenant)) if is_tenant_id(tenant) => Some(tenant.clone()),
            (None, Some(_)) => {
                return Err(
                    "--tenant takes a tenant id (32 lower-case hex digits, or anonymous); for a key use --key".into()
                )
            }
            (None, None) => None,
        };
        if let Some(user) = &self.user {
            let Some(tenant) = tenant else { return Err("--user names an end user of --key or --tenant".into()) };
            if user.trim().is_empty() {
                return Err("--user: empty".into());
            }
            return Ok(Some(Owner { id: end_user_owner(&tenant, user.trim()), kind: Kind::EndUser }));
        }
        if let Some(tenant) = tenant {
            return Ok(Some(Owner { id: tenant, kind: Kind::Tenant }));
        }
        if let Some(value) = &self.per_value {
            let header = match (&self.header, policy) {
                (Some(header), _) => header.trim().to_ascii_lowercase(),
                (None, Some(policy)) => {
                    let headers: std::collections::BTreeSet<&str> = policy
                        .limits
                        .iter()
                        .filter_map(|l| match &l.per {
                            Per::Header { name, .. } => Some(name.as_str()),
                            _ => None,
                        })
                        .collect();
                    match headers.into_iter().collect::<Vec<_>>()[..] {
                        [one] => one.to_string(),
                        [] => return Err("--per-value: no limit of the config is counted per a header".into()),
                        ref several => {
                            return Err(format!(
                                "--per-value: the config's limits are counted per several headers ({}): choose with \
                                 --header",
                                several.join(", ")
                            ))
                        }
                    }
                }
                (None, None) => return Err("--per-value needs --header (or --config)".into()),
            };
            return Ok(Some(Owner { id: pool_owner(&header, value.trim()), kind: Kind::Pool(Some(header)) }));
        }
        if self.all {
            return Ok(Some(Owner { id: ALL_OWNER.into(), kind: Kind::All }));
        }
        if let Some(id) = &self.owner {
            if !is_owner_id(id) {
                return Err(format!(
                    "--owner {id:?} is not an owner id (32 lower-case hex digits, anonymous, p or u and 32 hex \
                     digits, all)"
                ));
            }
            return Ok(Some(Owner { id: id.clone(), kind: Kind::of_id(id) }));
        }
        Ok(None)
    }
}

/// `limit`'s capacity `amount` in the config's unit as the script counts it (dollars to
/// micro-dollars), checked against the range of a plan's capacity.
fn capacity(limit: &Limit, amount: &str) -> Result<u64, String> {
    let name = &limit.name;
    let amount = amount.trim().replace('_', "");
    if amount.starts_with('-') {
        return Err(format!("{name}={amount}: a capacity is 0 or more"));
    }
    let value = match limit.measure {
        Measure::Usd { .. } => {
            let (whole, fraction) = amount.split_once('.').unwrap_or((&amount, ""));
            let digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
            if whole.is_empty() || !digits(whole) || !digits(fraction) || fraction.len() > 6 {
                return Err(format!(
                    "{name}={amount}: not an amount of dollars (a usd limit: e.g. 500 or 12.50, at most 6 decimals)"
                ));
            }
            let whole: u64 = whole.parse().map_err(|_| format!("{name}={amount}: too large"))?;
            let micro: u64 = format!("{fraction:0<6}").parse().unwrap_or(0);
            whole.checked_mul(1_000_000).and_then(|w| w.checked_add(micro))
        }
        _ => {
            if amount.is_empty() || !amount.bytes().all(|b| b.is_ascii_digit()) {
                return Err(format!("{name}={amount}: not a whole number"));
            }
            amount.parse::<u64>().ok()
        }
    };
    match value {
        Some(v) if v <= MAX_PLAN_CAPACITY => Ok(v),
        _ => {
            let max = match limit.measure {
                Measure::Usd { .. } => format!("${}", MAX_PLAN_CAPACITY / 1_000_000),
                _ => MAX_PLAN_CAPACITY.to_string(),
            };
            Err(format!("{name}={amount}: above the largest capacity, {max}"))
        }
    }
}

/// The config's limit `name`, counted per owners of `kind`; or why not.
fn limit_for<'a>(policy: &'a Policy, name: &str, kind: &Kind) -> Result<&'a Limit, String> {
    let Some(limit) = policy.limit(name) else {
        let known: Vec<&str> = policy.limits.iter().map(|l| l.name.as_str()).collect();
        return Err(format!("the config has no limit {name:?} (it has {})", known.join(", ")));
    };
    if !kind.counts(limit) {
        return Err(format!("{name} is counted {}, and the owner is {}", per_text(&limit.per), kind.describe()));
    }
    Ok(limit)
}

/// `--expires`: an RFC 3339 instant or a date (UTC midnight), in ms since the epoch.
fn parse_instant(text: &str) -> Result<u64, String> {
    let bad = || format!("--expires {text:?}: give an RFC 3339 instant (2027-01-01T00:00:00Z) or a date (2027-01-01)");
    let (date, time) = match text.split_once(['T', 't', ' ']) {
        Some((date, time)) => (date, Some(time)),
        None => (text, None),
    };
    let day = llm_ratelimit_protocol::ledger::parse_day(date).ok_or_else(bad)?;
    let days = llm_ratelimit_protocol::ledger::civil_from_day(day).ok_or_else(bad)?;
    let mut ms = days * 86_400_000;
    if let Some(time) = time {
        let (clock, offset_ms) = if let Some(clock) = time.strip_suffix(['Z', 'z']) {
            (clock, 0)
        } else {
            let at = time.rfind(['+', '-']).ok_or_else(bad)?;
            let (clock, offset) = time.split_at(at);
            let sign = if offset.starts_with('-') { -1 } else { 1 };
            let (h, m) = offset[1..].split_once(':').ok_or_else(bad)?;
            let (h, m): (i64, i64) = (h.parse().map_err(|_| bad())?, m.parse().map_err(|_| bad())?);
            (clock, sign * (h * 3600 + m * 60) * 1000)
        };
        let (hms, fraction) = clock.split_once('.').unwrap_or((clock, ""));
        let parts: Vec<i64> = hms.split(':').map(|p| p.parse::<i64>()).collect::<Result<_, _>>().map_err(|_| bad())?;
        let [h, m, s] = parts[..] else { return Err(bad()) };
        if !(0..24).contains(&h) || !(0..60).contains(&m) || !(0..61).contains(&s) {
            return Err(bad());
        }
        let millis: i64 = if fraction.is_empty() {
            0
        } else if fraction.bytes().all(|b| b.is_ascii_digit()) {
            format!("{:0<3}", &fraction[..fraction.len().min(3)]).parse().map_err(|_| bad())?
        } else {
            return Err(bad());
        };
        ms += (h * 3600 + m * 60 + s) * 1000 + millis - offset_ms;
    }
    u64::try_from(ms).map_err(|_| bad())
}

fn set(args: &SetArgs) -> Result<(), String> {
    let policy = policy_of(&args.config)?;
    let owner = args
        .who
        .owner(Some(&policy))?
        .ok_or("name the owner: --key, --tenant, --per-value, --all, --user or --owner")?;
    let mut capacities = BTreeMap::new();
    for given in &args.capacities {
        let (name, amount) =
            given.split_once('=').ok_or_else(|| format!("{given:?}: give a capacity as NAME=AMOUNT (tpm=2000000)"))?;
        let limit = limit_for(&policy, name.trim(), &owner.kind)?;
        if capacities.insert(limit.name.clone(), capacity(limit, amount)?.into()).is_some() {
            return Err(format!("{name} is given twice"));
        }
    }
    for name in &args.clear {
        limit_for(&policy, name, &owner.kind)?;
    }
    let change = PlanChange {
        domain: policy.domain.clone(),
        owner: owner.id.clone(),
        capacities,
        clear: args.clear.clone(),
        suspend: args.suspend.clone(),
        unsuspend: args.unsuspend,
        expires_ms: args.expires.as_deref().map(parse_instant).transpose()?.map(Into::into),
        at_expiry: args.at_expiry.clone(),
        no_expiry: args.no_expiry,
        note: args.note.clone(),
        replace: args.replace,
    };
    let changed = change.capacities.is_empty()
        && change.clear.is_empty()
        && change.suspend.is_none()
        && !change.unsuspend
        && change.expires_ms.is_none()
        && change.at_expiry.is_none()
        && !change.no_expiry
        && change.note.is_none()
        && !change.replace;
    if changed {
        return Err("nothing to change: give NAME=AMOUNT, --clear, --suspend, --unsuspend, --expires, --note".into());
    }
    let body = serde_json::to_string(&change).map_err(|e| e.to_string())?;
    let reply: PlanChanged = parse(&args.connection.call("POST", PLAN_PATH, Some(body))?)?;
    match &reply.after {
        Some(_) => eprintln!("set the plan of {} in domain {}", reply.owner, policy.domain),
        None => eprintln!("the plan of {} in domain {} is empty now: removed", reply.owner, policy.domain),
    }
    println!("{}", serde_json::to_string(&reply).map_err(|e| e.to_string())?);
    Ok(())
}

/// Lines per import call.
const IMPORT_PART: usize = 5000;

fn import(args: &ImportArgs) -> Result<(), String> {
    let policy = policy_of(&args.config)?;
    let text = if args.file.as_os_str() == "-" {
        let mut text = String::new();
        std::io::Read::read_to_string(&mut std::io::stdin(), &mut text).map_err(|e| format!("standard input: {e}"))?;
        text
    } else {
        std::fs::read_to_string(&args.file).map_err(|e| format!("cannot read {}: {e}", args.file.display()))?
    };
    let lines: Vec<&str> = text.lines().collect();
    // Here first: each line's limits against the config (the companion does not know it).
    let mut errors = Vec::new();
    // Times are the companion's to check, by Redis's clock; here by this machine's, a day
    // early, so that a clock a little off refuses nothing the companion takes.
    let now_ms = crate::tenant::now_ms().saturating_sub(86_400_000);
    for (n, line) in lines.iter().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let checked = check_line(line, &policy.domain, now_ms).and_then(|(owner, change)| {
            let kind = Kind::of_id(&owner);
            change.caps.keys().try_for_each(|name| limit_for(&policy, name, &kind).map(drop))
        });
        if let Err(message) = checked {
            errors.push(format!("line {}: {message}", n + 1));
        }
    }
    if !errors.is_empty() {
        let shown: Vec<&String> = errors.iter().take(20).collect();
        let more = errors.len().saturating_sub(shown.len());
        let more = if more > 0 { format!("\n(and {more} more)") } else { String::new() };
        return Err(format!(
            "{} bad line(s), nothing written:\n{}{more}",
            errors.len(),
            shown.iter().map(|s| s.as_str()).collect::<Vec<_>>().join("\n")
        ));
    }
    // Then the companion checks every part before any is written.
    let parts: Vec<(usize, String)> = lines
        .chunks(IMPORT_PART.min(MAX_IMPORT_LINES))
        .enumerate()
        .map(|(i, c)| (i * IMPORT_PART + 1, c.join("\n")))
        .collect();
    for dry_run in [true, false] {
        if !dry_run && args.dry_run {
            break;
        }
        let mut written = 0;
        for (first_line, body) in &parts {
            let path = format!("{IMPORT_PATH}?domain={}&dry_run={dry_run}&first_line={first_line}", policy.domain);
            let reply: ImportReply = parse(&args.connection.call("POST", &path, Some(body.clone())).map_err(|e| {
                if written > 0 {
                    format!("{e} ({written} plans written before this part; import again to finish)")
                } else {
                    e
                }
            })?)?;
            written += reply.written;
        }
        if !dry_run {
            eprintln!("imported {written} plans into domain {}", policy.domain);
        }
    }
    if args.dry_run {
        eprintln!("{} lines good; nothing written (--dry-run)", lines.iter().filter(|l| !l.trim().is_empty()).count());
    }
    Ok(())
}

/// Plans per export page.
const EXPORT_PAGE: usize = 1000;

fn export(args: &ExportArgs) -> Result<(), String> {
    let (domain, _) = args.place.resolve()?;
    let mut out: Box<dyn Write> = match &args.output {
        Some(path) => Box::new(std::io::BufWriter::new(
            std::fs::File::create(path).map_err(|e| format!("cannot write {}: {e}", path.display()))?,
        )),
        None => Box::new(std::io::BufWriter::new(std::io::stdout().lock())),
    };
    let mut after: Option<String> = None;
    let mut count = 0usize;
    loop {
        let cursor = after.as_deref().map(|a| format!("&after={a}")).unwrap_or_default();
        let path = format!("{PLANS_PATH}?domain={domain}&prefix={}&limit={EXPORT_PAGE}{cursor}", args.prefix);
        let page: PlanPage = parse(&args.connection.call("GET", &path, None)?)?;
        for plan in &page.plans {
            let line = serde_json::to_string(plan).map_err(|e| e.to_string())?;
            writeln!(out, "{line}").map_err(|e| format!("writing: {e}"))?;
            count += 1;
        }
        match page.next {
            Some(next) => after = Some(next),
            None => break,
        }
    }
    out.flush().map_err(|e| format!("writing: {e}"))?;
    eprintln!("exported {count} plans of domain {domain}");
    Ok(())
}

impl Connection {
    fn token(&self) -> Result<String, String> {
        match (&self.admin_token, &self.admin_token_file) {
            (_, Some(path)) => std::fs::read_to_string(path)
                .map(|t| t.trim_end().to_string())
                .map_err(|e| format!("cannot read --admin-token-file {}: {e}", path.display())),
            (Some(token), None) => Ok(token.clone()),
            (None, None) => Err("the companion's admin credential is required: set LLMRL_ADMIN_TOKEN or \
                                 --admin-token-file (the filter's token cannot administer plans)"
                .into()),
        }
    }

    /// One call to the companion; its body, or its error in words.
    fn call(&self, method: &str, path: &str, body: Option<String>) -> Result<String, String> {
        let token = self.token()?;
        let config =
            ureq::Agent::config_builder().http_status_as_error(false).timeout_global(Some(self.timeout)).build();
        let agent = ureq::Agent::new_with_config(config);
        let url = format!("{}{path}", self.companion.trim_end_matches('/'));
        let sent = match (method, body) {
            ("GET", _) => agent.get(&url).header(TOKEN_HEADER, &token).call(),
            ("DELETE", _) => agent.delete(&url).header(TOKEN_HEADER, &token).call(),
            (_, body) => agent
                .post(&url)
                .header(TOKEN_HEADER, &token)
                .header("content-type", "application/json")
                .send(body.unwrap_or_default()),
        };
        answer(&url, sent)
    }
}

/// The companion's answer, with an import's bad lines spelled out.
fn answer(url: &str, sent: Result<ureq::http::Response<ureq::Body>, ureq::Error>) -> Result<String, String> {
    let mut response = sent.map_err(|e| format!("cannot reach the companion at {url}: {e}"))?;
    let status = response.status();
    let body = response
        .body_mut()
        .with_config()
        .limit(64 * 1024 * 1024)
        .read_to_string()
        .map_err(|e| format!("reading the companion's answer: {e}"))?;
    if status.is_success() {
        return Ok(body);
    }
    let value: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
    let mut message = value.get("error").and_then(|e| e.as_str()).map_or(body.clone(), str::to_string);
    if let Some(errors) = value.pointer("/import/errors").and_then(|e| e.as_array()) {
        for entry in errors {
            let line = entry.get("line").and_then(serde_json::Value::as_u64).unwrap_or(0);
            let error = entry.get("error").and_then(|e| e.as_str()).unwrap_or("");
            message.push_str(&format!("\nline {line}: {error}"));
        }
    }
    Err(format!("the companion answered {}: {message}", status.as_u16()))
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONFIG: &str = r#"{"companion": {"upstream": "c", "token": "secret-token-0123456789"}, "domain": "prod",
        "prices": [{"match": "*", "input": 1, "output": 1}],
        "limits": [{"name": "rpm", "requests": 20, "window": "1m"},
                   {"name": "monthly-usd", "usd": 100, "window": "30d"},
                   {"name": "team-tpm", "tokens": 1000, "window": "1m", "per": {"header": "x-team"}},
                   {"name": "upstream", "tokens": 5000, "window": "1m", "per": "all"},
                   {"name": "user-rpm", "requests": 5, "window": "1m", "per": "end_user"}]}"#;

    fn policy() -> Policy {
        Policy::from_json(CONFIG.as_bytes()).expect("valid config")
    }

    #[test]
    fn capacities_are_read_in_the_configs_unit_and_range() {
        let policy = policy();
        let rpm = policy.limit("rpm").expect("rpm");
        let usd = policy.limit("monthly-usd").expect("usd");
        assert_eq!(capacity(rpm, "2_000_000"), Ok(2_000_000));
        assert_eq!(capacity(rpm, "0"), Ok(0));
        assert_eq!(capacity(usd, "500"), Ok(500_000_000));
        assert_eq!(capacity(usd, "12.5"), Ok(12_500_000));
        assert_eq!(capacity(usd, "0.000001"), Ok(1));
        assert_eq!(capacity(usd, "1000000"), Ok(MAX_PLAN_CAPACITY));
        for (limit, bad, says) in [
            (rpm, "-5", "0 or more"),
            (rpm, "1.5", "not a whole number"),
            (rpm, "1000000000001", "above the largest capacity, 1000000000000"),
            (rpm, "99999999999999999999999", "above"),
            (usd, "1000000.01", "above the largest capacity, $1000000"),
            (usd, "0.0000001", "at most 6 decimals"),
            (usd, "$5", "not an amount of dollars"),
        ] {
            let err = capacity(limit, bad).err().unwrap_or_default();
            assert!(err.contains(says), "{bad}: {err}");
        }
    }

    #[test]
    fn a_limit_is_named_by_the_config_and_counted_per_the_owner() {
        let policy = policy();
        assert!(limit_for(&policy, "rpm", &Kind::Tenant).is_ok());
        let err = limit_for(&policy, "rmp", &Kind::Tenant).err().unwrap_or_default();
        assert!(err.contains(r#"no limit "rmp" (it has rpm, monthly-usd, team-tpm, upstream, user-rpm)"#), "{err}");
        let err = limit_for(&policy, "team-tpm", &Kind::Tenant).err().unwrap_or_default();
        assert!(err.contains(r#"counted per the header "x-team", and the owner is a tenant"#), "{err}");
        assert!(limit_for(&policy, "team-tpm", &Kind::Pool(Some("x-team".into()))).is_ok());
        assert!(limit_for(&policy, "team-tpm", &Kind::Pool(Some("x-org".into()))).is_err());
        assert!(limit_for(&policy, "upstream", &Kind::All).is_ok());
        assert!(limit_for(&policy, "rpm", &Kind::EndUser).is_err(), "rpm is the tenant's");
        assert!(limit_for(&policy, "user-rpm", &Kind::EndUser).is_ok());
        assert!(limit_for(&policy, "user-rpm", &Kind::Tenant).is_err());
    }

    #[test]
    fn owners_are_named_as_the_filter_names_them() {
        let policy = policy();
        let who = |key: Option<&str>, tenant: Option<&str>, per_value: Option<&str>, user: Option<&str>| Who {
            key: key.map(Into::into),
            tenant: tenant.map(Into::into),
            per_value: per_value.map(Into::into),
            header: None,
            all: false,
            user: user.map(Into::into),
            owner: None,
        };
        let tenant = "200b482a0a785564144b9f1b4f3f1104";
        let key = who(Some("sk-a"), None, None, None).owner(Some(&policy)).expect("ok").expect("owner");
        assert_eq!(key, Owner { id: tenant.into(), kind: Kind::Tenant });
        let user = who(None, Some(tenant), None, Some("alice")).owner(Some(&policy)).expect("ok").expect("owner");
        assert_eq!(user.id, end_user_owner(tenant, "alice"));
        let team = who(None, None, Some("team-a"), None).owner(Some(&policy)).expect("ok").expect("owner");
        assert_eq!(team.id, pool_owner("x-team", "team-a"));
        assert!(who(None, Some("sk-a"), None, None).owner(Some(&policy)).is_err_and(|e| e.contains("--tenant takes")));
        assert!(who(None, None, None, Some("bob")).owner(Some(&policy)).is_err_and(|e| e.contains("--user names")));
        let raw = Who { owner: Some("xyz".into()), ..who(None, None, None, None) };
        assert!(raw.owner(None).is_err_and(|e| e.contains("not an owner id")));
    }

    #[test]
    fn expiry_takes_an_instant_or_a_date() {
        assert_eq!(parse_instant("2027-01-01"), Ok(1_798_761_600_000));
        assert_eq!(parse_instant("2027-01-01T00:00:00Z"), Ok(1_798_761_600_000));
        assert_eq!(parse_instant("2027-01-01T01:30:00.25+01:30"), Ok(1_798_761_600_250));
        assert_eq!(parse_instant("2026-12-31T19:00:00-05:00"), Ok(1_798_761_600_000));
        for bad in ["2027-13-01", "2027-01-01T25:00:00Z", "tomorrow", "2027-01-01T00:00", "1798761600"] {
            assert!(parse_instant(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_fingerprint_is_the_companions() {
        // companion/src/plans.rs computes the same (its test pins the shape).
        assert_eq!(fingerprint(b"admin-credential-0123456789"), "admin:ccb039607a765b0f");
    }
}
