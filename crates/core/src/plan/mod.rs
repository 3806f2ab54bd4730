//! What the compiled policy makes of a request, still pure: the charge plan (every limit
//! a request counts against, its token estimate), the metric series it is counted in, and
//! its settlement (what it gives back, as the wire has it).

pub mod charge;
pub mod pools;
pub mod series;
pub mod settlement;
