//! The admin API of plans (see [`crate::plans`] for a plan's Redis format): what an
//! operator sends the companion to set, show, delete, list, import and export owners'
//! plans, and reads back of their audit log. The `llm-ratelimit plan` command sends these;
//! the filter never does. Every endpoint takes the admin credential.
//!
//! - `POST PLAN_PATH` a [`PlanChange`] (set: create or change one owner's plan), answered
//!   with a [`PlanChanged`];
//! - `GET PLAN_PATH?domain=D&owner=O` one owner's [`Plan`] (404 if it has none);
//! - `DELETE PLAN_PATH?domain=D&owner=O` deletes it, answered with a [`PlanChanged`];
//! - `GET PLANS_PATH?domain=D&prefix=P&after=C&limit=N` a page of plans ([`PlanPage`]) in
//!   owner-id order, those whose owner id starts with `prefix`, after owner id `after` (the
//!   page's `next`): a stable cursor, so the pages of a domain are its export;
//! - `POST IMPORT_PATH?domain=D&dry_run=true&first_line=N` JSON lines, a [`Plan`] a line
//!   (as the pages give them; `updated_ms` and `updated_by` are ignored), each replacing
//!   its owner's plan: every line checked first, nothing written if any is bad (a 400 with
//!   an [`ImportReply`] listing each bad line); `dry_run` only checks;
//! - `GET HISTORY_PATH?domain=D&owner=O&limit=N` the audit log, newest first ([`History`]).

use crate::plans::{
    is_owner_id, AT_EXPIRY_REVERT, AT_EXPIRY_SUSPEND, MAX_NOTE_CHARS, MAX_PLAN_CAPACITY, MAX_REASON_CHARS,
};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;

/// One owner's plan: set (`POST`), shown (`GET`), deleted (`DELETE`).
pub const PLAN_PATH: &str = "/v1/admin/plan";
/// A page of a domain's plans.
pub const PLANS_PATH: &str = "/v1/admin/plans";
/// Bulk import, JSON lines.
pub const IMPORT_PATH: &str = "/v1/admin/plans/import";
/// The audit log of plan changes.
pub const HISTORY_PATH: &str = "/v1/admin/plans/history";

/// Owner, kind and name of a domain's index of the owners that have a plan (a sorted set,
/// every member at score 0, so it is ordered by owner id and read by prefix). Not an owner
/// id (no tenant id is five letters long), so in a hash slot of its own on a cluster.
pub const INDEX_OWNER: &str = "plans";
pub const INDEX_KIND: &str = "plan-index";
pub const INDEX_NAME: &str = "owners";
/// Kind and name of a domain's audit log of plan changes (a stream, same owner as the
/// index, so the index and the log share a hash slot).
pub const AUDIT_KIND: &str = "plan-audit";
pub const AUDIT_NAME: &str = "log";
/// About how many changes the audit log keeps (`XADD … MAXLEN ~`): the oldest go first.
pub const AUDIT_MAX_ENTRIES: u64 = 100_000;

/// Most capacity overrides in one plan.
pub const MAX_PLAN_LIMITS: usize = 64;
/// Most plans in one page.
pub const MAX_PAGE: usize = 1000;
/// Most lines in one import call (the CLI sends a longer file in parts).
pub const MAX_IMPORT_LINES: usize = 20_000;
/// Most bytes of one import call.
pub const MAX_IMPORT_BYTES: usize = 16 * 1024 * 1024;
/// Most bad lines an import answer lists (it counts them all).
pub const MAX_IMPORT_ERRORS: usize = 100;
/// Most entries one history answer gives.
pub const MAX_HISTORY: usize = 1000;
/// The furthest a plan may end: ten years from now (a later instant is a mistake, such as
/// seconds taken for milliseconds the other way round).
pub const MAX_EXPIRY_AHEAD_MS: u64 = 10 * 366 * 24 * 3600 * 1000;

/// A limit's name as the filter's config allows it (`limits[].name`): 1 to 32 of a-z,
/// 0-9, `_`, `-`. The companion does not know the config; the CLI checks the name is one
/// of its limits.
pub fn is_limit_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 32
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
}

/// An owner's plan as stored: capacities in the script's unit (micro-dollars for a `usd`
/// limit). Also an import line (`updated_ms`, `updated_by` then ignored).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Plan {
    pub owner: String,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub capacities: BTreeMap<String, u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub suspended: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub at_expiry: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub updated_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub updated_by: Option<String>,
}

/// A change to one owner's plan (`POST PLAN_PATH`). Merged into the plan the owner has,
/// unless `replace`: then the plan becomes exactly what this says. A plan left with no
/// capacity, suspension, expiry or note is deleted.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlanChange {
    /// The filter config's `domain`.
    pub domain: String,
    /// The owner id ([`is_owner_id`]).
    pub owner: String,
    /// Capacities to set, by limit name, in the script's unit: whole numbers
    /// `0..=MAX_PLAN_CAPACITY` (0 refuses every request the limit applies to). Numbers as
    /// JSON gives them, checked here so an error names the limit.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub capacities: BTreeMap<String, Value>,
    /// Capacity overrides to remove (the config's capacity applies again).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub clear: Vec<String>,
    /// Suspend the owner, with this reason.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub suspend: Option<String>,
    /// Lift a suspension.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub unsuspend: bool,
    /// When the plan ends (ms since the epoch, Redis's clock): in the future, at most
    /// [`MAX_EXPIRY_AHEAD_MS`] ahead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_ms: Option<Value>,
    /// `revert` (the default) or `suspend`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub at_expiry: Option<String>,
    /// Remove the plan's end (and `at_expiry`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub no_expiry: bool,
    /// An operator's note; empty removes it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub replace: bool,
}

/// A change checked: what the plans script applies (its argument, as JSON).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct CheckedChange {
    pub replace: bool,
    pub caps: BTreeMap<String, u64>,
    pub clear: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub suspend: Option<String>,
    pub unsuspend: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expires_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub at_expiry: Option<String>,
    pub no_expiry: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// The answer to a set or a delete: the plan before and after (`None`: no plan).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlanChanged {
    pub owner: String,
    pub before: Option<Plan>,
    pub after: Option<Plan>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlanPage {
    pub plans: Vec<Plan>,
    /// The cursor of the next page (`after`), or `None` after the last.
    pub next: Option<String>,
}

/// One line of an import that cannot be applied.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LineError {
    /// 1-based, counted from the call's `first_line`.
    pub line: usize,
    pub error: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImportReply {
    /// Plans written (0 on a dry run, or when any line is bad).
    pub written: usize,
    /// Lines checked and good.
    pub checked: usize,
    /// Bad lines, the first [`MAX_IMPORT_ERRORS`] of them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub errors: Vec<LineError>,
    /// How many lines are bad in all.
    #[serde(default)]
    pub bad_lines: usize,
}

/// One change as the audit log holds it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuditEntry {
    /// The stream entry's id.
    pub id: String,
    /// When (ms since the epoch, Redis's clock).
    pub at_ms: u64,
    pub owner: String,
    /// `set`, `delete` or `import`.
    pub op: String,
    /// The admin credential's fingerprint (never the credential).
    pub by: String,
    pub before: Option<Plan>,
    pub after: Option<Plan>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct History {
    pub entries: Vec<AuditEntry>,
}

fn capacity(at: &str, value: &Value) -> Result<u64, String> {
    match value.as_u64() {
        Some(n) if n <= MAX_PLAN_CAPACITY => Ok(n),
        Some(n) => Err(format!("{at}: {n} is above the largest capacity, {MAX_PLAN_CAPACITY}")),
        None if value.as_i64().is_some() => Err(format!("{at}: {value} is negative (0..={MAX_PLAN_CAPACITY})")),
        None if value.is_number() => Err(format!(
            "{at}: {value} is not a whole number (0..={MAX_PLAN_CAPACITY}; a usd limit counts micro-dollars)"
        )),
        None => Err(format!("{at}: {value} is not a number")),
    }
}

fn limit_name(at: &str, name: &str) -> Result<(), String> {
    if is_limit_name(name) {
        Ok(())
    } else {
        Err(format!("{at}: {name:?} is not a limit name (1 to 32 of a-z, 0-9, '_', '-')"))
    }
}

fn text(at: &str, value: &str, max: usize) -> Result<(), String> {
    let chars = value.chars().count();
    if chars > max {
        return Err(format!("{at}: {chars} characters, at most {max}"));
    }
    if value.chars().any(char::is_control) {
        return Err(format!("{at}: holds a control character"));
    }
    Ok(())
}

/// `expires_ms` as a time: in the future by `now_ms` (Redis's clock), not absurdly far.
fn expiry(at: &str, value: &Value, now_ms: u64) -> Result<u64, String> {
    let Some(ms) = value.as_u64() else {
        return Err(format!("{at}: {value} is not a time in ms since the epoch"));
    };
    if ms <= now_ms {
        return Err(format!("{at}: {ms} is in the past (now is {now_ms}, by Redis's clock)"));
    }
    if ms - now_ms > MAX_EXPIRY_AHEAD_MS {
        return Err(format!("{at}: {ms} is more than ten years ahead (in ms since the epoch, not seconds?)"));
    }
    Ok(ms)
}

fn at_expiry(value: &str) -> Result<String, String> {
    if value == AT_EXPIRY_REVERT || value == AT_EXPIRY_SUSPEND {
        Ok(value.to_string())
    } else {
        Err(format!("at_expiry: {value:?} is not {AT_EXPIRY_REVERT:?} or {AT_EXPIRY_SUSPEND:?}"))
    }
}

/// The domain and owner of a call, checked.
pub fn check_owner(domain: &str, owner: &str) -> Result<(), String> {
    if !crate::is_key_part(domain) {
        return Err("domain: must be 1-64 of [A-Za-z0-9_.-]".into());
    }
    if !is_owner_id(owner) {
        return Err(format!(
            "owner: {owner:?} is not an owner id (a tenant id: 32 lower-case hex digits or anonymous; p or u and 32 \
             hex digits; all)"
        ));
    }
    Ok(())
}

impl PlanChange {
    /// Checks every field (`now_ms`: Redis's clock), naming the field of the first bad one.
    pub fn check(&self, now_ms: u64) -> Result<CheckedChange, String> {
        check_owner(&self.domain, &self.owner)?;
        let mut caps = BTreeMap::new();
        for (name, value) in &self.capacities {
            limit_name("capacities", name)?;
            caps.insert(name.clone(), capacity(&format!("capacities.{name}"), value)?);
        }
        for name in &self.clear {
            limit_name("clear", name)?;
            if caps.contains_key(name) {
                return Err(format!("clear: {name:?} is also given a capacity"));
            }
        }
        if caps.len() + self.clear.len() > MAX_PLAN_LIMITS {
            return Err(format!("capacities: at most {MAX_PLAN_LIMITS} limits"));
        }
        if let Some(reason) = &self.suspend {
            text("suspend", reason, MAX_REASON_CHARS)?;
            if reason.trim().is_empty() {
                return Err("suspend: give the reason (it is quoted in the refusal)".into());
            }
            if self.unsuspend {
                return Err("suspend and unsuspend: give one".into());
            }
        }
        if let Some(note) = &self.note {
            text("note", note, MAX_NOTE_CHARS)?;
        }
        let expires_ms = self.expires_ms.as_ref().map(|v| expiry("expires_ms", v, now_ms)).transpose()?;
        let at_expiry = self.at_expiry.as_deref().map(at_expiry).transpose()?;
        if self.no_expiry && (expires_ms.is_some() || at_expiry.is_some()) {
            return Err("no_expiry: not with expires_ms or at_expiry".into());
        }
        if self.replace && expires_ms.is_none() && at_expiry.is_some() {
            return Err("at_expiry: the plan has no expires_ms".into());
        }
        Ok(CheckedChange {
            replace: self.replace,
            caps,
            clear: self.clear.clone(),
            suspend: self.suspend.clone(),
            unsuspend: self.unsuspend,
            expires_ms,
            at_expiry,
            no_expiry: self.no_expiry,
            note: self.note.clone().filter(|n| !n.is_empty() || !self.replace),
        })
    }
}

/// One import line: a [`Plan`] (in the script's unit), checked as a change that replaces
/// the owner's plan. Numbers are read as JSON gives them so an error names the field.
pub fn check_line(line: &str, domain: &str, now_ms: u64) -> Result<(String, CheckedChange), String> {
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Line {
        owner: String,
        #[serde(default)]
        capacities: BTreeMap<String, Value>,
        #[serde(default)]
        suspended: Option<String>,
        #[serde(default)]
        expires_ms: Option<Value>,
        #[serde(default)]
        at_expiry: Option<String>,
        #[serde(default)]
        note: Option<String>,
        #[serde(default, rename = "updated_ms")]
        _updated_ms: Option<Value>,
        #[serde(default, rename = "updated_by")]
        _updated_by: Option<String>,
    }
    let line: Line = serde_json::from_str(line).map_err(|e| format!("not a plan: {e}"))?;
    let change = PlanChange {
        domain: domain.to_string(),
        owner: line.owner.clone(),
        capacities: line.capacities,
        suspend: line.suspended,
        expires_ms: line.expires_ms,
        at_expiry: line.at_expiry,
        note: line.note,
        replace: true,
        ..PlanChange::default()
    };
    let checked = change.check(now_ms)?;
    if checked.caps.is_empty() && checked.suspend.is_none() && checked.expires_ms.is_none() && checked.note.is_none() {
        return Err("an empty plan: give capacities, suspended, expires_ms or note".into());
    }
    Ok((line.owner, checked))
}

/// A plan hash's fields (as HGETALL gives them) as a [`Plan`]; fields it does not know
/// are left out, and a field that does not parse is an error naming it.
pub fn plan_of_fields<'a>(
    owner: &str,
    fields: impl IntoIterator<Item = (&'a str, &'a str)>,
) -> Result<Option<Plan>, String> {
    use crate::plans::*;
    let mut plan = Plan { owner: owner.to_string(), ..Plan::default() };
    let mut any = false;
    let number = |field: &str, value: &str| {
        value.parse::<u64>().map_err(|_| format!("the plan of {owner} holds {field} = {value:?}, not a number"))
    };
    for (field, value) in fields {
        any = true;
        if let Some(name) = field.strip_prefix(CAPACITY_FIELD_PREFIX) {
            plan.capacities.insert(name.to_string(), number(field, value)?);
        } else if field == SUSPENDED_FIELD {
            plan.suspended = Some(value.to_string());
        } else if field == EXPIRES_FIELD {
            plan.expires_ms = Some(number(field, value)?);
        } else if field == AT_EXPIRY_FIELD {
            plan.at_expiry = Some(value.to_string());
        } else if field == NOTE_FIELD {
            plan.note = Some(value.to_string());
        } else if field == UPDATED_MS_FIELD {
            plan.updated_ms = Some(number(field, value)?);
        } else if field == UPDATED_BY_FIELD {
            plan.updated_by = Some(value.to_string());
        }
    }
    Ok(any.then_some(plan))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const OWNER: &str = "0123456789abcdef0123456789abcdef";
    const NOW: u64 = 1_800_000_000_000;

    fn change(value: Value) -> Result<CheckedChange, String> {
        let change: PlanChange = serde_json::from_value(value).map_err(|e| e.to_string())?;
        change.check(NOW)
    }

    #[test]
    fn a_change_is_checked_field_by_field_naming_the_field() {
        let good = change(json!({"domain": "llm", "owner": OWNER, "capacities": {"tpm": 2_000_000, "monthly-usd": 0},
                                 "clear": ["rpm"], "expires_ms": NOW + 1, "at_expiry": "suspend", "note": "trial"}))
        .expect("good");
        assert_eq!(good.caps, BTreeMap::from([("monthly-usd".into(), 0), ("tpm".into(), 2_000_000)]));
        assert_eq!((good.expires_ms, good.at_expiry.as_deref()), (Some(NOW + 1), Some("suspend")));
        let bad = |value: Value, says: &str| {
            let err = change(value).err().unwrap_or_default();
            assert!(err.contains(says), "{err} (wanted {says:?})");
        };
        let with = |extra: Value| {
            let mut base = json!({"domain": "llm", "owner": OWNER});
            base.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            base
        };
        bad(with(json!({"capacities": {"tpm": -5}})), "capacities.tpm: -5 is negative");
        bad(with(json!({"capacities": {"tpm": 1.5}})), "capacities.tpm: 1.5 is not a whole number");
        bad(with(json!({"capacities": {"tpm": 1_000_000_000_001u64}})), "capacities.tpm: 1000000000001 is above");
        bad(with(json!({"capacities": {"tpm": "10"}})), "capacities.tpm: \"10\" is not a number");
        bad(with(json!({"capacities": {"TPM": 1}})), "capacities: \"TPM\" is not a limit name");
        bad(with(json!({"clear": ["a b"]})), "clear: \"a b\" is not a limit name");
        bad(with(json!({"capacities": {"tpm": 1}, "clear": ["tpm"]})), "clear: \"tpm\" is also given");
        bad(with(json!({"suspend": "x".repeat(201)})), "suspend: 201 characters, at most 200");
        bad(with(json!({"suspend": " "})), "suspend: give the reason");
        bad(with(json!({"suspend": "r", "unsuspend": true})), "suspend and unsuspend");
        bad(with(json!({"note": "n".repeat(501)})), "note: 501 characters");
        bad(with(json!({"expires_ms": NOW - 1})), "expires_ms: 1799999999999 is in the past");
        bad(with(json!({"expires_ms": NOW + MAX_EXPIRY_AHEAD_MS + 1})), "more than ten years ahead");
        bad(with(json!({"expires_ms": -1})), "expires_ms: -1 is not a time");
        bad(with(json!({"at_expiry": "never"})), "at_expiry: \"never\" is not");
        bad(with(json!({"no_expiry": true, "expires_ms": NOW + 5})), "no_expiry");
        bad(with(json!({"replace": true, "at_expiry": "revert"})), "the plan has no expires_ms");
        bad(with(json!({"capacity": {}})), "unknown field `capacity`");
        bad(json!({"domain": "llm", "owner": "sk-live-1"}), "owner: \"sk-live-1\" is not an owner id");
        bad(json!({"domain": "l l", "owner": OWNER}), "domain:");
    }

    #[test]
    fn an_import_line_is_a_plan_replacing_the_owners() {
        let (owner, checked) =
            check_line(&format!(r#"{{"owner": "p{OWNER}", "capacities": {{"rpm": 5}}, "updated_ms": 1}}"#), "llm", NOW)
                .expect("good");
        assert_eq!((owner.as_str(), checked.replace), (format!("p{OWNER}").as_str(), true));
        assert!(check_line(&format!(r#"{{"owner": "{OWNER}"}}"#), "llm", NOW).is_err_and(|e| e.contains("empty plan")));
        assert!(check_line(r#"{"owner": "x", "capacities": {"rpm": 5}}"#, "llm", NOW)
            .is_err_and(|e| e.contains("owner: \"x\"")));
        assert!(check_line("{", "llm", NOW).is_err_and(|e| e.starts_with("not a plan")));
    }

    #[test]
    fn a_plan_reads_back_from_its_hash_and_round_trips_as_json() {
        let fields = [
            ("cap:tpm", "2000000"),
            ("suspended", "leaked key"),
            ("expires_ms", "1800000000001"),
            ("at_expiry", "revert"),
            ("note", "n"),
            ("updated_ms", "1"),
            ("updated_by", "admin:ab"),
            ("later-field", "ignored"),
        ];
        let plan = plan_of_fields(OWNER, fields).expect("parses").expect("a plan");
        assert_eq!(plan.capacities["tpm"], 2_000_000);
        assert_eq!((plan.suspended.as_deref(), plan.expires_ms), (Some("leaked key"), Some(1_800_000_000_001)));
        let text = serde_json::to_string(&plan).expect("json");
        assert_eq!(
            text,
            format!(
                r#"{{"owner":"{OWNER}","capacities":{{"tpm":2000000}},"suspended":"leaked key","expires_ms":1800000000001,"at_expiry":"revert","note":"n","updated_ms":1,"updated_by":"admin:ab"}}"#
            )
        );
        assert_eq!(serde_json::from_str::<Plan>(&text).expect("reads"), plan);
        assert_eq!(plan_of_fields(OWNER, []).expect("empty"), None);
        assert!(plan_of_fields(OWNER, [("cap:tpm", "x")]).is_err_and(|e| e.contains("cap:tpm")));
    }

    #[test]
    fn limit_names_follow_the_configs_syntax() {
        for good in ["rpm", "monthly-usd", "a_1", &"x".repeat(32)] {
            assert!(is_limit_name(good), "{good}");
        }
        for bad in ["", "RPM", "a b", "cap:x", &"x".repeat(33), "ü"] {
            assert!(!is_limit_name(bad), "{bad}");
        }
    }
}
