//! The readers: what a request body asks for (`request`) and what a reply says it cost
//! (`usage`), over whichever framing the provider's route uses.

pub mod request;
pub mod usage;
