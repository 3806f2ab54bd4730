//! Plans: an owner's limits changed at runtime, without a config push. A plan is one Redis
//! hash per owner, written by the companion's admin endpoints and read by `lua/limits.lua`
//! inside the same script call that charges (so a change holds for every proxy's next
//! charge, atomically with it, with no extra round trip).
//!
//! The owner is whoever a limit's counter belongs to: a tenant (its 32-hex-digit id), a
//! pool (`p` and 32 hex digits: a team's or org's `per` header value, hashed), the pool of
//! every caller (`all`), or an end user of a shared key (`u` and 32 hex digits: the tenant
//! and the user, hashed; see the core's `plan::pools::end_user_owner`). A plan's key is in
//! its owner's hash slot (`keys::redis_key(prefix, domain, owner, PLAN_KIND, PLAN_NAME)`),
//! so the script reads it beside the owner's counters, on a cluster too.
//!
//! Fields of the hash (every one optional):
//! - `cap:<limit name>`: the limit's capacity for this owner instead of the config's, in
//!   the script's unit (requests, tokens, slots, micro-dollars), `0..=MAX_PLAN_CAPACITY`;
//!   0 refuses every request the limit applies to ("never");
//! - `suspended`: the reason the owner is suspended (every request refused with 403, not
//!   retryable); at most `MAX_REASON_CHARS`;
//! - `expires_ms`: when the plan ends (ms since the epoch, by Redis's clock); then
//!   `at_expiry` says what follows: `revert` (the default: the config's limits again; the
//!   key is also set to expire then) or `suspend` (the owner suspended, the reason saying
//!   the plan expired; the key stays until deleted);
//! - `note`, `updated_ms`, `updated_by`: for operators; the script ignores them.

/// Kind and name of an owner's plan key.
pub const PLAN_KIND: &str = "plan";
pub const PLAN_NAME: &str = "limits";

/// Field prefix of a limit's capacity override (`cap:tpm`).
pub const CAPACITY_FIELD_PREFIX: &str = "cap:";
/// Field holding the suspension's reason.
pub const SUSPENDED_FIELD: &str = "suspended";
/// Field holding the plan's end (ms since the epoch).
pub const EXPIRES_FIELD: &str = "expires_ms";
/// Field saying what follows the plan's end: [`AT_EXPIRY_REVERT`] or [`AT_EXPIRY_SUSPEND`].
pub const AT_EXPIRY_FIELD: &str = "at_expiry";
pub const AT_EXPIRY_REVERT: &str = "revert";
pub const AT_EXPIRY_SUSPEND: &str = "suspend";
/// Operators' fields, ignored by the script.
pub const NOTE_FIELD: &str = "note";
pub const UPDATED_MS_FIELD: &str = "updated_ms";
pub const UPDATED_BY_FIELD: &str = "updated_by";

/// The largest capacity a plan may set: the config's own bound on a limit's capacity.
pub const MAX_PLAN_CAPACITY: u64 = 1_000_000_000_000;
/// The longest suspension reason (it is quoted in the refusal's message).
pub const MAX_REASON_CHARS: usize = 200;
/// The longest note.
pub const MAX_NOTE_CHARS: usize = 500;

/// The first letter of an end user's owner id (not a hex digit, not `p`).
pub const END_USER_OWNER_PREFIX: &str = "u";

/// The reason a refusal gives for a plan that ended with `at_expiry: suspend`.
pub const EXPIRED_REASON: &str = "the plan expired";

/// Whether `owner` is an owner id a plan may belong to: a tenant id (32 lower-case hex
/// digits, or `anonymous`), a pool's or an end user's (`p` or `u` and 32 such digits), or
/// `all`.
pub fn is_owner_id(owner: &str) -> bool {
    let hex32 = |s: &str| s.len() == 32 && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    match owner {
        "all" | "anonymous" => true,
        _ => {
            hex32(owner)
                || owner
                    .strip_prefix(crate::keys::POOL_OWNER_PREFIX)
                    .or_else(|| owner.strip_prefix(END_USER_OWNER_PREFIX))
                    .is_some_and(hex32)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owner_ids_are_the_four_forms_and_nothing_else() {
        let hex = "0123456789abcdef0123456789abcdef";
        for good in [hex.to_string(), format!("p{hex}"), format!("u{hex}"), "all".into(), "anonymous".into()] {
            assert!(is_owner_id(&good), "{good}");
        }
        for bad in [
            "".to_string(),
            hex[..31].to_string(),
            hex.to_uppercase(),
            format!("x{hex}"),
            format!("p{hex}0"),
            "sk-live-123".into(),
            format!("{{{hex}}}"),
        ] {
            assert!(!is_owner_id(&bad), "{bad}");
        }
    }
}
