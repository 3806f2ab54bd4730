//! The running averages of completion lengths, by tenant and model, that size the next
//! reservations: a fixed table of `memory.average_slots` entries in shared data (a slot
//! holds one (tenant, model)'s average, tagged with a hash of the pair, so model names are
//! never stored and whoever collides just replaces it: it is an estimate), and each VM's
//! side of it.
//!
//! A request's path makes no shared-data call for them: the VM reads an average at most once
//! a tick, and what replies teach it is gathered and written on the tick, one
//! compare-and-swap per (tenant, model) that learned something. Before, every request read
//! its average once and rewrote it once (a read and a write per request, each read a call
//! back into the VM to allocate the value). A VM sees what it was taught at once; another
//! worker sees it within two ticks (one to write, one to read), as it does calibrations.

use crate::accounting::reservation::OutputAverage;
use crate::config::Policy;
use crate::effects::host::{shared_read, shared_update, Host};
use crate::effects::tables::keyed_hash;
use crate::protocol::keys;
use rustc_hash::FxHashMap;

/// The owner tag of a stored average: a hash of (tenant, model).
const OWNER_HASH_BYTES: usize = 8;

/// Averages a VM remembers reading in one tick, at most (beyond, a read is not kept).
const MAX_KNOWN: usize = 4_096;
/// (tenant, model) pairs with lessons waiting for the tick, at most, and lessons each: a
/// pair taught more within one tick, or a new pair once the table is full, is written at
/// once, as every lesson was before. At most 1,024 x 32 x 8 B = 256 KiB per VM.
const MAX_PENDING_PAIRS: usize = 1_024;
const MAX_PENDING_LESSONS: usize = 32;

/// Where (tenant, model)'s average lives: its hash (the VM's key for it) gives the slot and
/// the owner tag.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Pair(u64);

impl Pair {
    fn of(config: &Policy, tenant: &str, model: &str) -> Pair {
        Pair(keyed_hash(config.memory.slot_key, &[tenant, model]))
    }

    fn key(self, config: &Policy) -> String {
        let slot = (self.0 % u64::from(config.memory.average_slots.max(1))) as u32;
        keys::average_key(&config.domain, slot)
    }

    fn owner(self) -> [u8; OWNER_HASH_BYTES] {
        self.0.rotate_left(17).to_le_bytes()
    }

    /// This pair's average in a stored slot, if the slot holds this pair's.
    fn own(self, stored: Option<&[u8]>) -> Option<OutputAverage> {
        let (hash, payload) = stored?.split_at_checked(OWNER_HASH_BYTES)?;
        (hash == self.owner()).then(|| OutputAverage::from_bytes(payload)).flatten()
    }
}

/// `average` with `outputs` taught to it, in order.
fn taught(average: Option<OutputAverage>, outputs: &[u64]) -> Option<OutputAverage> {
    outputs
        .iter()
        .fold(average, |average, &output| Some(average.map_or(OutputAverage::first(output), |a| a.update(output))))
}

/// The average stored for (`tenant`, `model`), as every worker sees it.
pub fn stored_average(host: &mut impl Host, config: &Policy, tenant: &str, model: &str) -> Option<OutputAverage> {
    let pair = Pair::of(config, tenant, model);
    pair.own(shared_read(host, &pair.key(config)).as_deref())
}

/// Teaches `outputs` to `pair`'s stored average; what it became (`None`: the host refused).
fn write(host: &mut impl Host, config: &Policy, pair: Pair, outputs: &[u64]) -> Option<Option<OutputAverage>> {
    shared_update(host, &pair.key(config), |stored| {
        let next = taught(pair.own(stored), outputs);
        let value = next.map(|average| [&pair.owner()[..], &average.to_bytes()].concat());
        (value, next)
    })
}

/// One VM's side of the averages (see the module's comment).
#[derive(Debug, Default)]
pub struct VmAverages {
    /// Each pair's stored average as read or written since the last tick. (A pair is a
    /// keyed hash already: FxHash only spreads it.)
    known: FxHashMap<Pair, Option<OutputAverage>>,
    /// What replies taught since the last tick, by pair, in order.
    pending: FxHashMap<Pair, Vec<u64>>,
}

impl VmAverages {
    /// (`tenant`, `model`)'s average as this VM knows it: the stored one, read at most once a
    /// tick, with what this VM was taught since.
    pub fn get(&mut self, host: &mut impl Host, config: &Policy, tenant: &str, model: &str) -> Option<OutputAverage> {
        let pair = Pair::of(config, tenant, model);
        let stored = match self.known.get(&pair) {
            Some(stored) => *stored,
            None => {
                let stored = pair.own(shared_read(host, &pair.key(config)).as_deref());
                if self.known.len() < MAX_KNOWN {
                    self.known.insert(pair, stored);
                }
                stored
            }
        };
        taught(stored, self.pending.get(&pair).map_or(&[], Vec::as_slice))
    }

    /// Keeps a completion of `output` tokens for the tick.
    pub fn teach(&mut self, host: &mut impl Host, config: &Policy, tenant: &str, model: &str, output: u64) {
        let pair = Pair::of(config, tenant, model);
        let room = self.pending.len() < MAX_PENDING_PAIRS;
        match self.pending.get_mut(&pair) {
            Some(outputs) if outputs.len() < MAX_PENDING_LESSONS => outputs.push(output),
            None if room => {
                self.pending.insert(pair, vec![output]);
            }
            full => {
                let mut outputs = full.map(std::mem::take).unwrap_or_default();
                outputs.push(output);
                self.pending.remove(&pair);
                let written = write(host, config, pair, &outputs);
                self.remember(pair, written);
            }
        }
    }

    /// The tick: what was taught is written, and every average is read afresh next time
    /// (another worker may have written it).
    pub fn flush(&mut self, host: &mut impl Host, config: &Policy) {
        self.known.clear();
        for (pair, outputs) in std::mem::take(&mut self.pending) {
            let written = write(host, config, pair, &outputs);
            self.remember(pair, written);
        }
    }

    /// A new config: its slots and hashes are other ones.
    pub fn forget(&mut self) {
        self.known.clear();
        self.pending.clear();
    }

    fn remember(&mut self, pair: Pair, written: Option<Option<OutputAverage>>) {
        match written {
            Some(average) if self.known.len() < MAX_KNOWN => {
                self.known.insert(pair, average);
            }
            // Refused: the next read asks the host.
            _ => {
                self.known.remove(&pair);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::effects::host::HostKind;
    use crate::testing::{FakeHost, World};
    use std::cell::RefCell;
    use std::rc::Rc;

    const HOSTS: [HostKind; 2] = [HostKind::Envoy, HostKind::Nginx];

    fn calls(world: &Rc<RefCell<World>>, name: &str) -> u64 {
        world.borrow().host_calls.get(name).copied().unwrap_or(0)
    }

    fn config(average_slots: u32) -> Policy {
        let text = format!(
            r#"{{"companion": {{"upstream": "c", "token": "test-token-0123456789"}},
                "memory": {{"average_slots": {average_slots}}},
                "limits": [{{"name": "tpm", "tokens": 1000, "window": "1m"}}]}}"#
        );
        Policy::from_json(text.as_bytes()).expect("config")
    }

    #[test]
    fn what_a_vm_is_taught_it_sees_at_once_and_the_others_after_its_tick() {
        for kind in HOSTS {
            taught_on(kind);
        }
    }

    fn taught_on(kind: HostKind) {
        let config = config(64);
        let mut host = FakeHost::new(&World::new(kind));
        let (mut mine, mut other) = (VmAverages::default(), VmAverages::default());
        assert_eq!(mine.get(&mut host, &config, "t", "gpt-4o"), None);
        assert_eq!(other.get(&mut host, &config, "t", "gpt-4o"), None);
        mine.teach(&mut host, &config, "t", "gpt-4o", 40);
        mine.teach(&mut host, &config, "t", "gpt-4o", 60);
        let expected = OutputAverage::first(40).update(60);
        assert_eq!(mine.get(&mut host, &config, "t", "gpt-4o"), Some(expected));
        assert_eq!(stored_average(&mut host, &config, "t", "gpt-4o"), None, "nothing written before the tick");
        assert_eq!(other.get(&mut host, &config, "t", "gpt-4o"), None, "the other read this tick already");
        mine.flush(&mut host, &config);
        assert_eq!(stored_average(&mut host, &config, "t", "gpt-4o"), Some(expected));
        assert_eq!(other.get(&mut host, &config, "t", "gpt-4o"), None, "still its read of this tick");
        other.flush(&mut host, &config);
        assert_eq!(other.get(&mut host, &config, "t", "gpt-4o"), Some(expected));
        // Both workers' lessons end up in the stored average, each in its order.
        other.teach(&mut host, &config, "t", "gpt-4o", 10);
        mine.teach(&mut host, &config, "t", "gpt-4o", 20);
        other.flush(&mut host, &config);
        mine.flush(&mut host, &config);
        assert_eq!(stored_average(&mut host, &config, "t", "gpt-4o"), Some(expected.update(10).update(20)));
        assert_eq!(mine.get(&mut host, &config, "t", "gpt-4o"), Some(expected.update(10).update(20)));
    }

    #[test]
    fn a_read_costs_one_host_call_a_tick_and_a_lesson_none_until_the_tick() {
        let config = config(64);
        let world = World::new(HostKind::Nginx);
        let mut host = FakeHost::new(&world);
        let mut averages = VmAverages::default();
        for output in 0..10 {
            averages.get(&mut host, &config, "t", "m");
            averages.teach(&mut host, &config, "t", "m", output);
        }
        assert_eq!(calls(&world, "shared_get"), 1);
        assert_eq!(calls(&world, "shared_set"), 0);
        averages.flush(&mut host, &config);
        let after_tick = (calls(&world, "shared_get"), calls(&world, "shared_set"));
        assert_eq!(after_tick, (2, 1), "one compare-and-swap for ten lessons");
        averages.get(&mut host, &config, "t", "m");
        assert_eq!(calls(&world, "shared_get"), 2, "the tick's own write is known");
        // A second tick's lesson is taken in on top of the first's (Nginx: the write carries
        // the key's CAS, or it would be refused once the key exists).
        averages.teach(&mut host, &config, "t", "m", 100);
        averages.flush(&mut host, &config);
        assert_eq!(stored_average(&mut host, &config, "t", "m"), taught(None, &[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 100]));
    }

    #[test]
    fn a_pair_taught_past_its_room_is_written_at_once_losing_no_lesson() {
        let config = config(64);
        let world = World::new(HostKind::Envoy);
        let mut host = FakeHost::new(&world);
        let mut averages = VmAverages::default();
        let outputs: Vec<u64> = (1..=MAX_PENDING_LESSONS as u64 + 1).collect();
        for &output in &outputs {
            averages.teach(&mut host, &config, "t", "m", output);
        }
        assert_eq!(calls(&world, "shared_set"), 1);
        assert_eq!(stored_average(&mut host, &config, "t", "m"), taught(None, &outputs));
        assert!(averages.pending.is_empty());
        // New pairs past the table's room go straight to shared data as well.
        for i in 0..MAX_PENDING_PAIRS + 3 {
            averages.teach(&mut host, &config, &format!("tenant-{i}"), "m", 5);
        }
        assert_eq!(averages.pending.len(), MAX_PENDING_PAIRS);
        assert_eq!(
            stored_average(&mut host, &config, &format!("tenant-{}", MAX_PENDING_PAIRS + 2), "m"),
            taught(None, &[5])
        );
    }

    #[test]
    fn a_colliding_pair_never_reads_another_pairs_average() {
        let config = config(16); // the smallest table: collisions certain among 40 pairs
        let mut host = FakeHost::new(&World::new(HostKind::Envoy));
        let mut averages = VmAverages::default();
        for i in 0..40 {
            averages.teach(&mut host, &config, &format!("t{i}"), "m", 100 + i);
        }
        averages.flush(&mut host, &config);
        let mut fresh = VmAverages::default();
        for i in 0..40 {
            let seen = fresh.get(&mut host, &config, &format!("t{i}"), "m");
            assert!(seen.is_none() || seen == Some(OutputAverage::first(100 + i)), "{i}: {seen:?}");
        }
    }
}
