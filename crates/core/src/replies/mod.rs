//! What the filter tells a client itself: a local reply and its headers (`reply`), shaped
//! for the caller's API (`answers`) from the companion's decision (`decision`).

pub mod answers;
pub mod decision;
pub mod reply;
