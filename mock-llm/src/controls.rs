//! Controls that apply to every endpoint's reply, whatever the provider:
//!
//! - `x-mock-set-<name>: <value>` adds the header `<name>: <value>` to the reply, as an
//!   upstream that sends its own rate-limit headers would (`x-mock-set-retry-after: 30`,
//!   `x-mock-set-anthropic-ratelimit-requests-remaining: 7`);
//! - `x-mock-abort-after-bytes: N` sends the first N bytes of the reply's body, then
//!   breaks the connection without ending the body, as an upstream that crashes or resets
//!   mid-stream does.

use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::header::{HeaderName, CONTENT_LENGTH};
use axum::middleware::Next;
use axum::response::Response;
use futures_util::StreamExt;

const SET_PREFIX: &str = "x-mock-set-";

pub async fn apply(request: Request, next: Next) -> Response {
    let headers = request.headers().clone();
    let mut response = next.run(request).await;
    for (name, value) in &headers {
        let Some(reply_name) = name.as_str().strip_prefix(SET_PREFIX) else { continue };
        if let Ok(reply_name) = HeaderName::from_bytes(reply_name.as_bytes()) {
            response.headers_mut().append(reply_name, value.clone());
        }
    }
    match crate::header_u64(&headers, "x-mock-abort-after-bytes") {
        Some(limit) => cut_after(response, limit),
        None => response,
    }
}

/// The reply with its body cut after `limit` bytes by an error, which makes the server
/// drop the connection mid-body.
fn cut_after(response: Response, limit: u64) -> Response {
    let (mut parts, body) = response.into_parts();
    parts.headers.remove(CONTENT_LENGTH);
    let stream =
        futures_util::stream::unfold((body.into_data_stream(), limit, false), |(mut body, left, cut)| async move {
            if cut {
                return None;
            }
            if left == 0 {
                // What was sent goes out first: the server drops its unwritten buffer with
                // the connection.
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                let reset = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "mock-llm: aborted as asked");
                return Some((Err(reset), (body, 0, true)));
            }
            match body.next().await {
                Some(Ok(chunk)) => {
                    let keep = chunk.len().min(usize::try_from(left).unwrap_or(usize::MAX));
                    let piece: Bytes = chunk.slice(..keep);
                    Some((Ok(piece), (body, left - keep as u64, false)))
                }
                Some(Err(err)) => Some((Err(std::io::Error::other(err)), (body, 0, true))),
                // The whole body was shorter than the limit: it ends normally.
                None => None,
            }
        });
    Response::from_parts(parts, Body::from_stream(stream))
}
