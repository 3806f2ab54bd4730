//! The queue (`queue`): a direct charge that may wait in the companion for capacity, at
//! the request's priority, while this proxy's queue (and the tenant's share of it) has room.

use super::{single_header, RequestFilter};
use crate::config::Policy;
use crate::effects::host::{shared_update, Host};
use crate::effects::tables::queued_slot;
use crate::protocol::keys;
use crate::protocol::Wait;
use crate::worker::Worker;

impl RequestFilter {
    /// Takes a place in the queue, if queueing is on and this proxy's queue has room: the
    /// charge may then wait for capacity, in the companion, at this request's priority.
    pub(super) fn join_queue(&mut self, host: &mut impl Host, config: &Policy) -> Option<Wait> {
        let queue = &config.queue;
        if !queue.enabled() {
            return None;
        }
        // A place of the tenant's share first, then of the whole queue.
        let own = keys::queued_tenant_key(&config.domain, queued_slot(config, &self.tenant));
        if !take_place(host, &own, queue.max_per_tenant) {
            return None;
        }
        if !take_place(host, &keys::queued_key(&config.domain), queue.max_length) {
            give_place(host, &own);
            return None;
        }
        self.queued = true;
        let priority = queue
            .priority_header
            .as_deref()
            .and_then(|name| single_header(host, name))
            .and_then(|value| value.trim().parse::<u8>().ok())
            .filter(|p| *p <= 9)
            .or_else(|| queue.tier_priorities.get(&self.tier).copied())
            .unwrap_or(queue.default_priority);
        Some(Wait { max_ms: queue.max_wait.as_millis() as u64, priority, aging_ms: queue.aging.as_millis() as u64 })
    }

    pub(super) fn leave_queue(&mut self, host: &mut impl Host, config: &Policy) {
        if std::mem::take(&mut self.queued) {
            give_place(host, &keys::queued_key(&config.domain));
            give_place(host, &keys::queued_tenant_key(&config.domain, queued_slot(config, &self.tenant)));
        }
    }

    /// The charge waited `waited` ms in the companion's queue: counted, and kept for the
    /// record.
    pub(super) fn note_wait(&mut self, host: &mut impl Host, worker: &mut Worker, waited: u64) {
        if waited > 0 {
            worker.count_queue_wait(host, waited);
            self.recorded.queued_ms = waited;
        }
    }
}

/// Takes a place in the waiter count at `key` if fewer than `most` wait there.
fn take_place(host: &mut impl Host, key: &str, most: u32) -> bool {
    let joined = shared_update(host, key, |bytes| {
        let waiting = bytes.and_then(|b| b.try_into().ok()).map_or(0, u32::from_le_bytes);
        let room = waiting < most;
        (room.then(|| (waiting + 1).to_le_bytes().to_vec()), room)
    });
    joined == Some(true)
}

/// Gives back a place taken with `take_place`.
fn give_place(host: &mut impl Host, key: &str) {
    shared_update(host, key, |bytes| {
        let waiting = bytes.and_then(|b| b.try_into().ok()).map_or(0, u32::from_le_bytes);
        (Some(waiting.saturating_sub(1).to_le_bytes().to_vec()), ())
    });
}
