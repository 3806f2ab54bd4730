//! Any bytes as the body of every API: parsed, counted and rewritten without a panic.
#![no_main]
use libfuzzer_sys::fuzz_target;
use llm_ratelimit_core::request::{Api, LlmRequest};
use llm_ratelimit_core::tokens::Encoding;

fuzz_target!(|data: &[u8]| {
    for api in [Api::ChatCompletions, Api::Completions, Api::Responses, Api::Embeddings, Api::Messages] {
        if let Ok(request) = LlmRequest::parse(api, data) {
            let _ = request.prompt_tokens(Encoding::O200kBase);
            let _ = request.rewritten(true, Some(7));
        }
    }
});
