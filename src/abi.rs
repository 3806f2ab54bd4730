//! The proxy-wasm calls that carry what clients and upstreams send (header values, bodies)
//! and the shared data, declared here instead of taken from the SDK: the SDK's wrappers
//! panic on a header value that is not UTF-8 and on any status they do not expect, and a
//! panic kills the worker's VM (that worker then answers every request 503, or lets every
//! request through with `fail_open`). One request with a byte 0xFF in a header did that.
//! Here every status is an answer, every byte is read, and a value that is not UTF-8 is
//! read lossily (its bad bytes become U+FFFD, which no real credential holds).

use proxy_wasm::types::{BufferType, MapType};
use std::ptr::null_mut;

const OK: u32 = 0;
const NOT_FOUND: u32 = 1;
const CAS_MISMATCH: u32 = 8;

#[link(wasm_import_module = "env")]
extern "C" {
    fn proxy_get_header_map_value(
        map_type: MapType,
        key_data: *const u8,
        key_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
    ) -> u32;
    fn proxy_get_header_map_pairs(map_type: MapType, return_map_data: *mut *mut u8, return_map_size: *mut usize)
        -> u32;
    fn proxy_replace_header_map_value(
        map_type: MapType,
        key_data: *const u8,
        key_size: usize,
        value_data: *const u8,
        value_size: usize,
    ) -> u32;
    fn proxy_remove_header_map_value(map_type: MapType, key_data: *const u8, key_size: usize) -> u32;
    fn proxy_get_buffer_bytes(
        buffer_type: BufferType,
        start: usize,
        max_size: usize,
        return_buffer_data: *mut *mut u8,
        return_buffer_size: *mut usize,
    ) -> u32;
    fn proxy_set_buffer_bytes(
        buffer_type: BufferType,
        start: usize,
        size: usize,
        buffer_data: *const u8,
        buffer_size: usize,
    ) -> u32;
    fn proxy_get_shared_data(
        key_data: *const u8,
        key_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
        return_cas: *mut u32,
    ) -> u32;
    fn proxy_set_shared_data(
        key_data: *const u8,
        key_size: usize,
        value_data: *const u8,
        value_size: usize,
        cas: u32,
    ) -> u32;
    fn proxy_set_property(path_data: *const u8, path_size: usize, value_data: *const u8, value_size: usize) -> u32;
    fn proxy_get_current_time_nanoseconds(return_time: *mut u64) -> u32;
    fn proxy_continue_stream(stream_type: u32) -> u32;
    fn proxy_send_local_response(
        status_code: u32,
        status_code_details_data: *const u8,
        status_code_details_size: usize,
        body_data: *const u8,
        body_size: usize,
        headers_data: *const u8,
        headers_size: usize,
        grpc_status: i32,
    ) -> u32;
}

/// What the host wrote into memory it had this module allocate (`proxy_on_memory_allocate`,
/// the SDK's: a `Vec<u8>` of exactly `size`), taken back as a Vec that frees it.
///
/// SAFETY: `data` is null or was returned by the host for `size` bytes it allocated
/// through this module's allocator, and is not used again by anyone else.
unsafe fn take(data: *mut u8, size: usize) -> Vec<u8> {
    if data.is_null() || size == 0 {
        if !data.is_null() {
            // A zero-size allocation still gets freed.
            drop(unsafe { Vec::from_raw_parts(data, 0, 0) });
        }
        return Vec::new();
    }
    unsafe { Vec::from_raw_parts(data, size, size) }
}

/// A header value as text: lossily when it is not UTF-8.
pub fn text(bytes: Vec<u8>) -> String {
    String::from_utf8(bytes).unwrap_or_else(|err| String::from_utf8_lossy(err.as_bytes()).into_owned())
}

/// One header's value (the first, when it was sent more than once); `None` when absent or
/// when the host cannot say.
pub fn header_value(map: MapType, name: &str) -> Option<Vec<u8>> {
    let (mut data, mut size) = (null_mut(), 0);
    // SAFETY: the name is live for the call; the host fills the two out-pointers.
    let status = unsafe { proxy_get_header_map_value(map, name.as_ptr(), name.len(), &mut data, &mut size) };
    // SAFETY: what the host returned for this call.
    let value = unsafe { take(data, size) };
    (status == OK).then_some(value)
}

/// Every header of `map` in one call, as the host serialised them (`HeaderPairs` reads
/// them); empty when the host cannot say.
pub fn header_pairs(map: MapType) -> HeaderPairs {
    let (mut data, mut size) = (null_mut(), 0);
    // SAFETY: the host fills the two out-pointers.
    let status = unsafe { proxy_get_header_map_pairs(map, &mut data, &mut size) };
    // SAFETY: what the host returned for this call.
    let bytes = unsafe { take(data, size) };
    HeaderPairs { bytes: if status == OK { bytes } else { Vec::new() } }
}

pub fn replace_header(map: MapType, name: &str, value: &str) -> Result<(), u32> {
    // SAFETY: both strings are live for the call.
    match unsafe { proxy_replace_header_map_value(map, name.as_ptr(), name.len(), value.as_ptr(), value.len()) } {
        OK => Ok(()),
        status => Err(status),
    }
}

pub fn remove_header(map: MapType, name: &str) -> Result<(), u32> {
    // SAFETY: the name is live for the call.
    match unsafe { proxy_remove_header_map_value(map, name.as_ptr(), name.len()) } {
        OK | NOT_FOUND => Ok(()),
        status => Err(status),
    }
}

/// Up to `max` bytes of a buffer from `start` (none when the host has none or will not say).
pub fn buffer(kind: BufferType, start: usize, max: usize) -> Vec<u8> {
    let (mut data, mut size) = (null_mut(), 0);
    // SAFETY: the host fills the two out-pointers.
    let status = unsafe { proxy_get_buffer_bytes(kind, start, max, &mut data, &mut size) };
    // SAFETY: what the host returned for this call.
    let bytes = unsafe { take(data, size) };
    if status == OK {
        bytes
    } else {
        Vec::new()
    }
}

pub fn set_buffer(kind: BufferType, start: usize, size: usize, bytes: &[u8]) -> Result<(), u32> {
    // SAFETY: the bytes are live for the call.
    match unsafe { proxy_set_buffer_bytes(kind, start, size, bytes.as_ptr(), bytes.len()) } {
        OK => Ok(()),
        status => Err(status),
    }
}

/// A shared-data value and its CAS (`(None, None)` when absent or unreadable).
pub fn shared_data(key: &str) -> (Option<Vec<u8>>, Option<u32>) {
    let (mut data, mut size, mut cas) = (null_mut(), 0, 0u32);
    // SAFETY: the key is live for the call; the host fills the three out-pointers.
    let status = unsafe { proxy_get_shared_data(key.as_ptr(), key.len(), &mut data, &mut size, &mut cas) };
    let present = !data.is_null();
    // SAFETY: what the host returned for this call.
    let value = unsafe { take(data, size) };
    match status {
        // As the SDK read it: no data is no value, whatever the CAS.
        OK => (present.then_some(value), (cas > 0).then_some(cas)),
        _ => (None, None),
    }
}

pub enum SharedWrite {
    Written,
    CasMismatch,
    Refused(u32),
}

pub fn set_shared_data(key: &str, value: &[u8], cas: Option<u32>) -> SharedWrite {
    // SAFETY: key and value are live for the call.
    match unsafe { proxy_set_shared_data(key.as_ptr(), key.len(), value.as_ptr(), value.len(), cas.unwrap_or(0)) } {
        OK => SharedWrite::Written,
        CAS_MISMATCH => SharedWrite::CasMismatch,
        status => SharedWrite::Refused(status),
    }
}

/// Sets a property of the current request (`path`'s segments joined by NUL, as the ABI
/// has it): the host's status on refusal (an unknown or read-only property).
pub fn set_property(path: &[&str], value: &[u8]) -> Result<(), u32> {
    let joined = path.join("\0");
    // SAFETY: path and value are live for the call.
    match unsafe { proxy_set_property(joined.as_ptr(), joined.len(), value.as_ptr(), value.len()) } {
        OK => Ok(()),
        status => Err(status),
    }
}

/// The host's clock in nanoseconds since the epoch (0 if it will not say).
pub fn now_nanos() -> u64 {
    let mut now = 0u64;
    // SAFETY: the host fills the out-pointer.
    if unsafe { proxy_get_current_time_nanoseconds(&mut now) } == OK {
        now
    } else {
        0
    }
}

/// Lets the paused request go on (the ABI's stream type 0, the HTTP request). A host may
/// refuse (the stream already ended): said as an error, not a panic.
pub fn continue_request() -> Result<(), u32> {
    // SAFETY: a plain host call taking an integer.
    match unsafe { proxy_continue_stream(0) } {
        OK => Ok(()),
        status => Err(status),
    }
}

/// Answers the request from the filter with this status, headers and body.
pub fn send_local_response(status: u32, headers: &[(&str, &str)], body: &[u8]) -> Result<(), u32> {
    let headers = serialize_pairs(headers);
    // SAFETY: headers and body are live for the call; no details, no gRPC status (-1).
    match unsafe {
        proxy_send_local_response(
            status,
            std::ptr::null(),
            0,
            // No body at all for an empty one, as the SDK sends it.
            if body.is_empty() { std::ptr::null() } else { body.as_ptr() },
            body.len(),
            headers.as_ptr(),
            headers.len(),
            -1,
        )
    } {
        OK => Ok(()),
        status => Err(status),
    }
}

/// Header pairs in the ABI's serialisation (see `HeaderPairs`).
fn serialize_pairs(pairs: &[(&str, &str)]) -> Vec<u8> {
    let size = 4 + pairs.iter().map(|(n, v)| n.len() + v.len() + 10).sum::<usize>();
    let mut bytes = Vec::with_capacity(size);
    bytes.extend_from_slice(&(pairs.len() as u32).to_le_bytes());
    for (name, value) in pairs {
        bytes.extend_from_slice(&(name.len() as u32).to_le_bytes());
        bytes.extend_from_slice(&(value.len() as u32).to_le_bytes());
    }
    for (name, value) in pairs {
        for part in [name.as_bytes(), value.as_bytes()] {
            bytes.extend_from_slice(part);
            bytes.push(0);
        }
    }
    bytes
}

/// A header map as the ABI serialises it: a count, each pair's two lengths, then each name
/// and value followed by a NUL. Read in place, every length checked: malformed input from
/// the host reads as fewer headers, never as a panic.
pub struct HeaderPairs {
    bytes: Vec<u8>,
}

impl HeaderPairs {
    fn u32_at(&self, at: usize) -> Option<usize> {
        let word: [u8; 4] = self.bytes.get(at..at.checked_add(4)?)?.try_into().ok()?;
        Some(u32::from_le_bytes(word) as usize)
    }

    /// Every (name, value), in the host's order.
    pub fn iter(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        let count = self.u32_at(0).unwrap_or(0);
        // The lengths table: 8 bytes a pair; a count the bytes cannot hold reads as none.
        let count = if count.checked_mul(8).and_then(|n| n.checked_add(4)).is_some_and(|end| end <= self.bytes.len()) {
            count
        } else {
            0
        };
        let mut at = 4 + count * 8;
        (0..count).map_while(move |i| {
            let (name_len, value_len) = (self.u32_at(4 + i * 8)?, self.u32_at(8 + i * 8)?);
            let name = self.bytes.get(at..at.checked_add(name_len)?)?;
            let value_at = at.checked_add(name_len)?.checked_add(1)?;
            let value = self.bytes.get(value_at..value_at.checked_add(value_len)?)?;
            at = value_at.checked_add(value_len)?.checked_add(1)?;
            Some((name, value))
        })
    }

    /// The values of `name` (ASCII case ignored: Nginx keeps the client's spelling), in order.
    pub fn values<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a [u8]> + 'a {
        self.iter().filter(move |(n, _)| n.eq_ignore_ascii_case(name.as_bytes())).map(|(_, v)| v)
    }
}
