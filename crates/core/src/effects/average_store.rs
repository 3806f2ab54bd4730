//! The running averages of completion lengths, by tenant and model, that size the next
//! reservations: a fixed table of `memory.average_slots` entries in shared data (a slot
//! holds one (tenant, model)'s average, tagged with a hash of the pair, so model names are
//! never stored and whoever collides just replaces it: it is an estimate), and each VM's
//! side of it.
//!
//! A request's path makes no shared-data call for them once its average is known: what
//! replies teach is gathered and written on the tick, one compare-and-swap per (tenant,
//! model), and the shared-data traffic follows what changed, not the request rate:
//! - A first average, or lessons that move one by more than an eighth, are written on the
//!   next tick, and an average not learned yet is looked for again every tick: another
//!   worker sees a new tenant's first average within two ticks.
//! - Lessons that barely move an average wait for the settling tick, once a second, and an
//!   average a VM has read stands for it until then: a steady tenant costs each worker one
//!   read and one write a second, not one of each a request (at a low rate the tick's
//!   writes were a request's costliest host calls).
//!
//! A VM sees what it was taught at once.

use crate::accounting::reservation::OutputAverage;
use crate::config::Policy;
use crate::effects::host::{shared_read, shared_update, Host};
use crate::effects::tables::keyed_hash;
use crate::protocol::keys;
use rustc_hash::FxHashMap;

/// The owner tag of a stored average: a hash of (tenant, model).
const OWNER_HASH_BYTES: usize = 8;

/// Averages a VM remembers, learned and not learned yet, at most each (beyond, a read is
/// not kept).
const MAX_KNOWN: usize = 4_096;
/// (tenant, model) pairs with lessons waiting for a tick, at most, and lessons each: a pair
/// taught more before its lessons are written, or a new pair once the table is full, is
/// written at once. At most 1,024 x 32 x 8 B = 256 KiB per VM.
const MAX_PENDING_PAIRS: usize = 1_024;
const MAX_PENDING_LESSONS: usize = 32;
/// Lessons that move an average by more than this share of it are written on the next
/// tick; the rest wait for the settling tick. (A reservation is 1.5 x the average: an
/// eighth of it is well inside that margin.)
const MATERIAL_SHARE: f64 = 0.125;

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

/// A pair's lessons not written yet, in order, and what they make of its average as the
/// VM knew it at the first (so a tick tells whether they matter without going over them).
#[derive(Debug)]
struct Lessons {
    outputs: Vec<u64>,
    known: Option<OutputAverage>,
    taught: Option<OutputAverage>,
}

impl Lessons {
    fn new(known: Option<OutputAverage>) -> Lessons {
        Lessons { outputs: Vec::new(), known, taught: known }
    }

    fn push(&mut self, output: u64) {
        self.outputs.push(output);
        self.taught = taught(self.taught, &[output]);
    }

    /// Whether they move the average enough to write now: a first average always does.
    fn material(&self) -> bool {
        match (self.known, self.taught) {
            (Some(before), Some(after)) => (after.mean - before.mean).abs() > MATERIAL_SHARE * before.mean.max(1.0),
            _ => true,
        }
    }
}

/// One VM's side of the averages (see the module's comment).
#[derive(Debug, Default)]
pub struct VmAverages {
    /// Each learned average as read or written since the settling tick. (A pair is a keyed
    /// hash already: FxHash only spreads it.)
    learned: FxHashMap<Pair, OutputAverage>,
    /// The pairs read with no average since the last tick.
    unlearned: rustc_hash::FxHashSet<Pair>,
    /// What replies taught and is not written yet, by pair.
    pending: FxHashMap<Pair, Lessons>,
    /// The pairs whose lessons a tick writes (kept to reuse its room).
    due: Vec<Pair>,
    /// When the last settling tick ran.
    settled_ms: u64,
}

impl VmAverages {
    /// (`tenant`, `model`)'s average as this VM knows it: the stored one, as read (see the
    /// module's comment), with what this VM was taught since.
    pub fn get(&mut self, host: &mut impl Host, config: &Policy, tenant: &str, model: &str) -> Option<OutputAverage> {
        let pair = Pair::of(config, tenant, model);
        let stored = match self.learned.get(&pair) {
            Some(&average) => Some(average),
            None if self.unlearned.contains(&pair) => None,
            None => {
                let stored = pair.own(shared_read(host, &pair.key(config)).as_deref());
                self.remember(pair, stored);
                stored
            }
        };
        taught(stored, self.pending.get(&pair).map_or(&[], |lessons| lessons.outputs.as_slice()))
    }

    /// Keeps a completion of `output` tokens for a tick.
    pub fn teach(&mut self, host: &mut impl Host, config: &Policy, tenant: &str, model: &str, output: u64) {
        let pair = Pair::of(config, tenant, model);
        let room = self.pending.len() < MAX_PENDING_PAIRS;
        match self.pending.get_mut(&pair) {
            Some(lessons) if lessons.outputs.len() < MAX_PENDING_LESSONS => lessons.push(output),
            None if room => {
                let mut lessons = Lessons::new(self.learned.get(&pair).copied());
                lessons.push(output);
                self.pending.insert(pair, lessons);
            }
            full => {
                let mut outputs = full.map(|lessons| std::mem::take(&mut lessons.outputs)).unwrap_or_default();
                outputs.push(output);
                self.pending.remove(&pair);
                self.write(host, config, pair, &outputs);
            }
        }
    }

    /// The tick: the lessons that matter are written (all of them on the settling tick,
    /// once a second), and the averages not learned yet are read afresh next time (all of
    /// them after the settling tick: another worker may have written them).
    pub fn flush(&mut self, host: &mut impl Host, config: &Policy, now_ms: u64) {
        self.unlearned.clear();
        if now_ms.saturating_sub(self.settled_ms) >= super::host::SETTLE.as_millis() as u64 {
            self.settled_ms = now_ms;
            self.settle(host, config);
            return;
        }
        let mut due = std::mem::take(&mut self.due);
        due.extend(self.pending.iter().filter(|(_, lessons)| lessons.material()).map(|(pair, _)| *pair));
        for pair in due.drain(..) {
            if let Some(lessons) = self.pending.remove(&pair) {
                self.write(host, config, pair, &lessons.outputs);
            }
        }
        self.due = due;
    }

    /// Writes every lesson, and lets go of every average read (a new config's averages are
    /// read afresh; the settling tick's, by then, may be stale).
    pub fn settle(&mut self, host: &mut impl Host, config: &Policy) {
        self.learned.clear();
        for (pair, lessons) in std::mem::take(&mut self.pending) {
            self.write(host, config, pair, &lessons.outputs);
        }
    }

    /// A new config: its slots and hashes are other ones.
    pub fn forget(&mut self) {
        self.learned.clear();
        self.unlearned.clear();
        self.pending.clear();
    }

    /// Teaches `outputs` to `pair`'s stored average, and remembers what it became (a write
    /// the host refused is read afresh next time).
    fn write(&mut self, host: &mut impl Host, config: &Policy, pair: Pair, outputs: &[u64]) {
        match write(host, config, pair, outputs) {
            Some(average) => self.remember(pair, average),
            None => {
                self.learned.remove(&pair);
                self.unlearned.remove(&pair);
            }
        }
    }

    fn remember(&mut self, pair: Pair, stored: Option<OutputAverage>) {
        match stored {
            Some(average) => {
                self.unlearned.remove(&pair);
                if self.learned.len() < MAX_KNOWN || self.learned.contains_key(&pair) {
                    self.learned.insert(pair, average);
                }
            }
            None => {
                self.learned.remove(&pair);
                if self.unlearned.len() < MAX_KNOWN {
                    self.unlearned.insert(pair);
                }
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
        mine.flush(&mut host, &config, 0);
        assert_eq!(stored_average(&mut host, &config, "t", "gpt-4o"), Some(expected));
        assert_eq!(other.get(&mut host, &config, "t", "gpt-4o"), None, "still its read of this tick");
        other.flush(&mut host, &config, 0);
        assert_eq!(other.get(&mut host, &config, "t", "gpt-4o"), Some(expected));
        // Both workers' lessons end up in the stored average, each in its order.
        other.teach(&mut host, &config, "t", "gpt-4o", 10);
        mine.teach(&mut host, &config, "t", "gpt-4o", 20);
        other.flush(&mut host, &config, 0);
        mine.flush(&mut host, &config, 0);
        assert_eq!(stored_average(&mut host, &config, "t", "gpt-4o"), Some(expected.update(10).update(20)));
        assert_eq!(mine.get(&mut host, &config, "t", "gpt-4o"), Some(expected.update(10).update(20)));
    }

    #[test]
    fn a_first_average_costs_one_read_and_its_lessons_one_write_on_the_tick() {
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
        averages.flush(&mut host, &config, 0);
        let after_tick = (calls(&world, "shared_get"), calls(&world, "shared_set"));
        assert_eq!(after_tick, (2, 1), "one compare-and-swap for ten lessons");
        averages.get(&mut host, &config, "t", "m");
        assert_eq!(calls(&world, "shared_get"), 2, "the tick's own write is known");
        // A second tick's lesson is taken in on top of the first's (Nginx: the write carries
        // the key's CAS, or it would be refused once the key exists).
        averages.teach(&mut host, &config, "t", "m", 100);
        averages.flush(&mut host, &config, 0);
        assert_eq!(stored_average(&mut host, &config, "t", "m"), taught(None, &[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 100]));
    }

    #[test]
    fn a_steady_average_costs_a_read_and_a_write_a_second_a_moving_or_first_one_goes_out_on_the_tick() {
        for kind in HOSTS {
            steady_on(kind);
        }
    }

    fn steady_on(kind: HostKind) {
        let config = config(64);
        let world = World::new(kind);
        let mut host = FakeHost::new(&world);
        let (mut mine, mut other) = (VmAverages::default(), VmAverages::default());
        let settle = crate::effects::host::SETTLE.as_millis() as u64;
        let tick = crate::effects::host::TICK.as_millis() as u64;
        let host_calls = |world: &Rc<RefCell<World>>| (calls(world, "shared_get"), calls(world, "shared_set"));
        // Both workers settle at 1 s; the first average goes out on the next tick.
        mine.flush(&mut host, &config, settle);
        other.flush(&mut host, &config, settle);
        assert_eq!(mine.get(&mut host, &config, "t", "m"), None);
        mine.teach(&mut host, &config, "t", "m", 100);
        mine.flush(&mut host, &config, settle + tick);
        assert_eq!(stored_average(&mut host, &config, "t", "m"), Some(OutputAverage::first(100)));
        assert_eq!(other.get(&mut host, &config, "t", "m"), Some(OutputAverage::first(100)));
        // Steady replies: a second of ticks makes no shared-data call, for either worker.
        let before = host_calls(&world);
        let mut expected = OutputAverage::first(100);
        for k in 2..settle / tick {
            assert_eq!(mine.get(&mut host, &config, "t", "m"), Some(expected));
            assert_eq!(other.get(&mut host, &config, "t", "m"), Some(OutputAverage::first(100)));
            mine.teach(&mut host, &config, "t", "m", 104);
            expected = expected.update(104);
            mine.flush(&mut host, &config, settle + k * tick);
            other.flush(&mut host, &config, settle + k * tick);
        }
        assert_eq!(host_calls(&world), before, "small lessons wait, a read average stands");
        assert_eq!(mine.get(&mut host, &config, "t", "m"), Some(expected), "its own lessons it sees at once");
        // The settling tick writes them in one compare-and-swap, and lets the others' reads go.
        mine.flush(&mut host, &config, 2 * settle);
        other.flush(&mut host, &config, 2 * settle);
        assert_eq!(host_calls(&world), (before.0 + 1, before.1 + 1));
        assert_eq!(stored_average(&mut host, &config, "t", "m"), Some(expected));
        assert_eq!(other.get(&mut host, &config, "t", "m"), Some(expected));
        // A lesson that moves the average by more than an eighth goes out on the next tick.
        mine.teach(&mut host, &config, "t", "m", 1_000);
        mine.flush(&mut host, &config, 2 * settle + tick);
        assert_eq!(stored_average(&mut host, &config, "t", "m"), Some(expected.update(1_000)));
        assert_eq!(other.get(&mut host, &config, "t", "m"), Some(expected), "read before, it stands");
        other.flush(&mut host, &config, 3 * settle);
        assert_eq!(other.get(&mut host, &config, "t", "m"), Some(expected.update(1_000)));
        // A pair read with no average is looked for again after every tick.
        assert_eq!(other.get(&mut host, &config, "new", "m"), None);
        mine.teach(&mut host, &config, "new", "m", 7);
        mine.flush(&mut host, &config, 3 * settle + tick);
        assert_eq!(other.get(&mut host, &config, "new", "m"), None, "not before its own tick");
        other.flush(&mut host, &config, 3 * settle + tick);
        assert_eq!(other.get(&mut host, &config, "new", "m"), Some(OutputAverage::first(7)));
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
        averages.flush(&mut host, &config, 0);
        let mut fresh = VmAverages::default();
        for i in 0..40 {
            let seen = fresh.get(&mut host, &config, &format!("t{i}"), "m");
            assert!(seen.is_none() || seen == Some(OutputAverage::first(100 + i)), "{i}: {seen:?}");
        }
    }
}
