//! How the message APIs' prompts are counted: OpenAI's published formula for chat
//! messages (the cookbook's `num_tokens_from_messages`: 3 tokens per message, 1 per
//! `name`, 3 to prime the reply), which Anthropic's messages and Bedrock's Converse are
//! counted by too, their content parts included (text, images, tool use and results,
//! Responses' input items). Tool definitions, images and the other structures have no
//! published formula; they are approximated (tool JSON counted as text, an image as a
//! fixed cost) and settled against the provider's own usage afterwards. Shared by the
//! providers' body shapes, so it sits below them.

use crate::api::text_leaves;
use crate::parse::json::{Json, Kind};

/// Tokens charged for one image part: a 1024x1024 image at high detail for GPT-4o.
pub const IMAGE_TOKENS: u64 = 765;
const TOKENS_PER_MESSAGE: u64 = 3;
const TOKENS_PER_NAME: u64 = 1;
const REPLY_PRIMING: u64 = 3;

/// A JSON number read as a count (a negative or non-number is none).
pub fn as_count(value: Json) -> Option<u64> {
    value.as_u64().or_else(|| value.as_f64().filter(|f| *f >= 0.0).map(|f| f as u64))
}

/// OpenAI's message formula, also used for Anthropic's messages.
pub fn chat_messages(messages: Json, count: &mut (impl FnMut(&str) -> u64 + ?Sized)) -> u64 {
    let Some(messages) = messages.as_array() else {
        return 0;
    };
    let mut total = REPLY_PRIMING;
    for message in messages {
        total += TOKENS_PER_MESSAGE;
        let Some(fields) = message.as_object() else {
            continue;
        };
        for (key, value) in fields {
            total += match key {
                "role" => value.as_str().map_or(0, &mut *count),
                "name" => value.as_str().map_or(0, &mut *count) + TOKENS_PER_NAME,
                "content" => content(value, count),
                "tool_calls" => {
                    value.as_array().map_or(0, |calls| calls.map(|c| text_leaves(c.at("function"), count)).sum())
                }
                "function_call" => text_leaves(value, count),
                "tool_call_id" => 0,
                _ => 0,
            };
        }
    }
    total
}

/// Content as a string, or a list of parts (text, image, tool use and result, input
/// items). Text is counted; images cost `IMAGE_TOKENS`; structured inputs count as text.
pub fn content(value: Json, count: &mut (impl FnMut(&str) -> u64 + ?Sized)) -> u64 {
    match value.kind() {
        Kind::String(text) => count(text),
        Kind::Array(parts) => parts.map(|part| content_part(part, count)).sum(),
        Kind::Object(_) => content_part(value, count),
        _ => 0,
    }
}

fn content_part(part: Json, count: &mut (impl FnMut(&str) -> u64 + ?Sized)) -> u64 {
    match part.at("type").as_str().unwrap_or("") {
        "image_url" | "input_image" | "image" => IMAGE_TOKENS,
        // Bedrock Converse's blocks are keyed by kind, with no `type`.
        "" if part.get("image").is_some_and(|image| image.is_object()) => IMAGE_TOKENS,
        // Responses API message items: {role, content}; count like a chat message.
        _ if part.get("role").is_some() && part.get("content").is_some() => {
            TOKENS_PER_MESSAGE + part.at("role").as_str().map_or(0, &mut *count) + content(part.at("content"), count)
        }
        _ => text_leaves(part, count),
    }
}

pub fn tools(value: Json, count: &mut (impl FnMut(&str) -> u64 + ?Sized)) -> u64 {
    value.as_array().map_or(0, |tools| tools.map(|t| text_leaves(t, count)).sum())
}

/// A prompt or embedding input: a string, strings, token ids, or lists of token ids.
pub fn inputs(value: Json, count: &mut (impl FnMut(&str) -> u64 + ?Sized)) -> u64 {
    match value.kind() {
        Kind::String(text) => count(text),
        Kind::Number(_) => 1,
        Kind::Array(items) => items.map(|item| inputs(item, count)).sum(),
        _ => 0,
    }
}
