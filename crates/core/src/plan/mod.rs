//! What the compiled policy makes of a request, still pure: the charge plan (every limit
//! a request counts against, its token estimate) and the metric series it is counted in.

pub mod charge;
pub mod series;
