//! The base parsers: bytes to structure, knowing nothing of APIs or limits. A JSON scanner
//! that reads only what is asked of it, the two streamed framings replies come in (SSE,
//! AWS event stream) and Gemini's streamed JSON array, and the one normalisation of a
//! request path.

pub mod eventstream;
pub(crate) mod json;
pub mod json_array_stream;
pub mod path;
pub mod sse;
