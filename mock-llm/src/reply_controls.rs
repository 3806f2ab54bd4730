//! Controls that make a reply hard to read for whatever stands between the client and the
//! provider, as real providers' replies can be (the reply side of the adversarial tests):
//!
//! - `x-mock-compress: 1`: the reply is compressed with the first of `gzip`, `deflate`,
//!   `br` the request's `accept-encoding` names (none named: sent plain), with
//!   `content-encoding` set, as OpenAI compresses for clients that accept it;
//!   `x-mock-compress: 2` compresses with gzip whatever the request accepts (an upstream
//!   that ignores `accept-encoding`);
//! - `x-mock-cut-after-bytes: N`: only the first N bytes of the body are sent, then the
//!   connection is reset, after `x-mock-cut-pause-ms` (default 0), so a client can also
//!   leave first while the mock holds the rest (with 0, hyper meets the reset before it
//!   has sent the headers: an upstream that fails before answering);
//! - `x-mock-reasoning-tokens: N` (OpenAI, Anthropic): N more output tokens the client
//!   never sees, in the usage (`completion_tokens_details.reasoning_tokens` inside
//!   `completion_tokens`; Anthropic's `output_tokens`, which count thinking). Gemini's is
//!   `x-mock-thoughts-tokens` (gemini.rs).

use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::{HeaderMap, HeaderValue};
use axum::middleware::Next;
use axum::response::Response;
use std::io::Write;
use std::time::Duration;

/// The largest reply body these controls collect to rewrite.
const MAX_BODY: usize = 64 << 20;

/// `x-mock-reasoning-tokens`: hidden output tokens the usage reports.
pub fn reasoning_tokens(headers: &HeaderMap) -> u64 {
    crate::header_u64(headers, "x-mock-reasoning-tokens").unwrap_or(0)
}

/// The middleware applying `x-mock-compress` and `x-mock-cut-after-bytes` to any reply.
pub async fn apply(request: Request, next: Next) -> Response {
    let headers = request.headers().clone();
    let response = next.run(request).await;
    let coding = match crate::header_u64(&headers, "x-mock-compress") {
        None | Some(0) => None,
        Some(1) => accepted(&headers),
        Some(_) => Some("gzip"),
    };
    let cut = crate::header_u64(&headers, "x-mock-cut-after-bytes");
    if coding.is_none() && cut.is_none() {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let Ok(mut bytes) = axum::body::to_bytes(body, MAX_BODY).await else {
        return Response::from_parts(parts, Body::empty());
    };
    if let Some(coding) = coding {
        if let Some(compressed) = compress(coding, &bytes) {
            bytes = Bytes::from(compressed);
            parts.headers.insert("content-encoding", HeaderValue::from_static(coding));
            parts.headers.remove("content-length");
        }
    }
    let Some(cut) = cut else { return Response::from_parts(parts, Body::from(bytes)) };
    parts.headers.remove("content-length");
    let pause = Duration::from_millis(crate::header_u64(&headers, "x-mock-cut-pause-ms").unwrap_or(0));
    let sent = bytes.slice(..(cut as usize).min(bytes.len()));
    // An error from the body stream makes hyper reset the connection mid-body.
    let stream = futures_util::stream::unfold(Some(sent), move |state| async move {
        match state {
            Some(sent) => Some((Ok::<Bytes, std::io::Error>(sent), None)),
            None => {
                crate::pause(pause).await;
                Some((Err(std::io::Error::other("x-mock-cut-after-bytes")), Some(Bytes::new())))
            }
        }
    });
    // The reset ends the reply: nothing after the first error.
    let stream = futures_util::StreamExt::scan(stream, false, |failed, item| {
        let done = *failed;
        *failed |= item.is_err();
        std::future::ready((!done).then_some(item))
    });
    Response::from_parts(parts, Body::from_stream(stream))
}

/// The first coding of the mock's own that the request's `accept-encoding` names.
fn accepted(headers: &HeaderMap) -> Option<&'static str> {
    let accept = headers.get("accept-encoding")?.to_str().ok()?.to_ascii_lowercase();
    let named: Vec<&str> = accept.split(',').map(|c| c.split(';').next().unwrap_or("").trim()).collect();
    ["gzip", "deflate", "br"].into_iter().find(|coding| named.contains(coding))
}

fn compress(coding: &str, bytes: &[u8]) -> Option<Vec<u8>> {
    match coding {
        "gzip" => {
            let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
            encoder.write_all(bytes).ok()?;
            encoder.finish().ok()
        }
        // HTTP's `deflate` is the zlib format.
        "deflate" => {
            let mut encoder = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
            encoder.write_all(bytes).ok()?;
            encoder.finish().ok()
        }
        "br" => {
            let mut out = Vec::new();
            brotli::BrotliCompress(&mut &bytes[..], &mut out, &brotli::enc::BrotliEncoderParams::default()).ok()?;
            Some(out)
        }
        _ => None,
    }
}
