//! What this VM has seen of the owners' plans (set at runtime in Redis, see
//! `protocol::plans`), so that the degraded mode decides with them while Redis is away: a
//! suspension seen stays one, a capacity seen sizes the local share. Learned from the
//! companion's replies only: a reply names a suspension, or a limit's capacity other than
//! the one the filter sent. An owner whose replies show neither is forgotten.
//!
//! Bounded: at most `capacity` owners, and only owners an operator gave a plan enter it
//! (a client inventing keys or header values invents owners without plans, which never
//! do); when full, the owner seen longest ago makes room.

use std::collections::HashMap;

/// The default bound: far more planned owners than one VM meets between two outages.
pub const DEFAULT_OWNERS: usize = 4096;

#[derive(Debug, Clone, PartialEq, Default)]
struct Seen {
    suspended: Option<String>,
    /// By the limit's index in the config: the plan's capacity.
    capacities: Vec<(usize, u64)>,
    seen_ms: u64,
}

#[derive(Debug)]
pub struct OwnerPlans {
    owners: HashMap<String, Seen>,
    capacity: usize,
}

impl Default for OwnerPlans {
    fn default() -> Self {
        OwnerPlans::new(DEFAULT_OWNERS)
    }
}

impl OwnerPlans {
    pub fn new(capacity: usize) -> OwnerPlans {
        OwnerPlans { owners: HashMap::new(), capacity: capacity.max(1) }
    }

    /// `owner` is suspended, for `reason`.
    pub fn suspend(&mut self, owner: &str, reason: &str, now_ms: u64) {
        let seen = self.entry(owner, now_ms);
        seen.suspended = Some(reason.to_string());
    }

    /// A reply that was no suspension answered for `owner`'s limit `limit`: the script
    /// counted `answered` where the filter sent `sent` (another figure: the plan's).
    pub fn answered(&mut self, owner: &str, limit: usize, sent: u64, answered: u64, now_ms: u64) {
        if sent == answered {
            let Some(seen) = self.owners.get_mut(owner) else { return };
            seen.suspended = None;
            seen.capacities.retain(|&(i, _)| i != limit);
            if seen.capacities.is_empty() {
                self.owners.remove(owner);
            }
            return;
        }
        let seen = self.entry(owner, now_ms);
        seen.suspended = None;
        match seen.capacities.iter_mut().find(|(i, _)| *i == limit) {
            Some(known) => known.1 = answered,
            None => seen.capacities.push((limit, answered)),
        }
    }

    /// The reason `owner` is suspended, if it was when last seen.
    pub fn suspended(&self, owner: &str) -> Option<&str> {
        self.owners.get(owner)?.suspended.as_deref()
    }

    /// `owner`'s capacity of limit `limit` by its plan, if one was seen.
    pub fn capacity(&self, owner: &str, limit: usize) -> Option<u64> {
        let seen = self.owners.get(owner)?;
        seen.capacities.iter().find(|(i, _)| *i == limit).map(|&(_, capacity)| capacity)
    }

    pub fn len(&self) -> usize {
        self.owners.len()
    }

    pub fn is_empty(&self) -> bool {
        self.owners.is_empty()
    }

    fn entry(&mut self, owner: &str, now_ms: u64) -> &mut Seen {
        if !self.owners.contains_key(owner) && self.owners.len() >= self.capacity {
            let oldest = self.owners.iter().min_by_key(|(_, seen)| seen.seen_ms).map(|(name, _)| name.clone());
            if let Some(oldest) = oldest {
                self.owners.remove(&oldest);
            }
        }
        let seen = self.owners.entry(owner.to_string()).or_default();
        seen.seen_ms = now_ms;
        seen
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_suspension_stays_until_a_reply_shows_none() {
        let mut plans = OwnerPlans::new(8);
        plans.suspend("t1", "key leaked", 10);
        assert_eq!(plans.suspended("t1"), Some("key leaked"));
        plans.answered("t1", 0, 100, 100, 20);
        assert_eq!(plans.suspended("t1"), None);
        assert!(plans.is_empty());
    }

    #[test]
    fn a_capacity_other_than_the_configs_is_kept_by_limit_and_dropped_when_it_matches_again() {
        let mut plans = OwnerPlans::new(8);
        plans.answered("t1", 1, 100, 2_000, 10);
        plans.answered("t1", 0, 5, 5, 10);
        assert_eq!((plans.capacity("t1", 1), plans.capacity("t1", 0)), (Some(2_000), None));
        plans.answered("t1", 1, 100, 0, 11);
        assert_eq!(plans.capacity("t1", 1), Some(0));
        plans.answered("t1", 1, 100, 100, 12);
        assert_eq!(plans.capacity("t1", 1), None);
        assert!(plans.is_empty());
    }

    #[test]
    fn owners_without_plans_never_enter_and_a_full_table_drops_the_oldest() {
        let mut plans = OwnerPlans::new(2);
        for i in 0..1000 {
            plans.answered(&format!("invented{i}"), 0, 10, 10, i);
        }
        assert!(plans.is_empty());
        plans.suspend("a", "r", 1);
        plans.suspend("b", "r", 2);
        plans.suspend("c", "r", 3);
        assert_eq!(plans.len(), 2);
        assert_eq!((plans.suspended("a"), plans.suspended("c")), (None, Some("r")));
    }
}
