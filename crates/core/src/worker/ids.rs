//! Ids this VM draws: reservation ids, unique per request across proxies, the VM's id in
//! the spend ledger, and its number among its proxy's VMs.

use super::Worker;
use crate::effects::host::{shared_update, Host};
use crate::protocol::keys;

impl Worker {
    pub(crate) fn new_reservation_id(&mut self, host: &mut impl Host) -> String {
        self.ids.next(host)
    }
}

/// Reservation ids, unique per request across proxies: a per-VM nonce from the clock at
/// first use and the VM's number in its proxy (there is no OS randomness in this wasm
/// target), mixed with a counter. The clock alone is not enough: ngx_wasm_module's has
/// millisecond resolution, and two workers whose first requests fell in the same
/// millisecond drew the same nonce (seen on a real nginx: four requests on two workers
/// left one reservation record, and their settlements one another's).
#[derive(Debug, Default)]
pub(super) struct ReservationIds {
    nonce: Option<u64>,
    /// This VM's number among the proxy's (see `take_vm_number`); 0 if none was taken.
    pub(super) vm: u64,
    counter: u64,
}

impl ReservationIds {
    pub(super) fn next(&mut self, host: &mut impl Host) -> String {
        let vm = self.vm;
        // `mix` is a bijection: VMs with different numbers draw different nonces even when
        // they read the same time.
        let nonce = *self.nonce.get_or_insert_with(|| mix(host.now_nanos() as u64 ^ mix(vm)));
        self.counter += 1;
        // `{:016x}{:x}` of the two, written by hand: every request draws one.
        let mut id = String::with_capacity(32);
        push_hex(&mut id, mix(nonce ^ self.counter), 16);
        let digits = (64 - self.counter.leading_zeros()).div_ceil(4).max(1) as usize;
        push_hex(&mut id, self.counter, digits);
        id
    }
}

impl ReservationIds {
    /// This VM's id in the spend ledger (16 hex digits): its batches are numbered apart
    /// from every other VM's.
    pub(super) fn ledger_id(&mut self, host: &mut impl Host) -> String {
        let vm = self.vm;
        let nonce = *self.nonce.get_or_insert_with(|| mix(host.now_nanos() as u64 ^ mix(vm)));
        let mut id = String::with_capacity(16);
        push_hex(&mut id, mix(nonce ^ 0x6c65_6467_6572), 16);
        id
    }
}

/// The next number among this proxy's VMs (1, 2, ...), from a counter in shared data.
pub(super) fn take_vm_number(host: &mut impl Host, domain: &str) -> u64 {
    let taken = shared_update(host, &keys::vm_numbers_key(domain), |stored| {
        let before = stored.and_then(|b| b.get(..8)).and_then(|b| b.try_into().ok()).map_or(0, u64::from_le_bytes);
        let number = before.wrapping_add(1);
        (Some(number.to_le_bytes().to_vec()), number)
    });
    taken.unwrap_or(0)
}

/// The low `digits` hex digits of `value`, most significant first, in lower case.
fn push_hex(out: &mut String, value: u64, digits: usize) {
    for shift in (0..digits).rev() {
        let nibble = ((value >> (4 * shift)) & 0xf) as u8;
        out.push(char::from(if nibble < 10 { b'0' + nibble } else { b'a' + nibble - 10 }));
    }
}

/// splitmix64: spreads a counter into well-mixed bits.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservation_ids_are_the_hex_of_the_mixed_nonce_and_the_counter() {
        for value in [0u64, 1, 9, 10, 15, 16, 255, 4096, u64::MAX] {
            let digits = (64 - value.leading_zeros()).div_ceil(4).max(1) as usize;
            let mut written = String::new();
            push_hex(&mut written, value, 16);
            push_hex(&mut written, value, digits);
            assert_eq!(written, format!("{value:016x}{value:x}"));
        }
    }
}
