//! Any bytes as the body of every API the filter reads, reached through the router as a
//! request's path reaches it (OpenAI's four, Anthropic's, Azure's deployment paths,
//! Gemini's and Vertex AI's three methods, Bedrock's Converse and invoke operations):
//! parsed, counted and rewritten without a panic.
#![no_main]
use libfuzzer_sys::fuzz_target;
use llm_ratelimit_core::providers;
use llm_ratelimit_core::api::Api;
use llm_ratelimit_core::readers::request::parse_on;
use llm_ratelimit_core::tokens::Encoding;

/// One path per API and provider, and the API its body is read as.
const PATHS: [(&str, Api); 15] = [
    ("/v1/chat/completions", Api::ChatCompletions),
    ("/v1/completions", Api::Completions),
    ("/v1/responses", Api::Responses),
    ("/v1/embeddings", Api::Embeddings),
    ("/v1/messages", Api::Messages),
    ("/openai/deployments/gpt4o/chat/completions?api-version=2024-10-21", Api::ChatCompletions),
    ("/openai/v1/responses", Api::Responses),
    ("/v1beta/models/gemini-2.0-flash:generateContent", Api::GenerateContent),
    ("/v1beta/models/gemini-2.0-flash:streamGenerateContent?alt=sse", Api::StreamGenerateContent),
    ("/v1beta/models/gemini-2.0-flash:countTokens", Api::CountTokens),
    (
        "/v1/projects/p/locations/us-central1/publishers/google/models/gemini-2.0-flash:generateContent",
        Api::GenerateContent,
    ),
    ("/model/amazon.nova-lite-v1%3A0/converse", Api::Converse),
    ("/model/amazon.nova-lite-v1%3A0/converse-stream", Api::Converse),
    ("/model/anthropic.claude-3-haiku-20240307-v1%3A0/invoke", Api::Messages),
    ("/model/anthropic.claude-3-haiku-20240307-v1%3A0/invoke-with-response-stream", Api::Messages),
];

/// Every API is in `PATHS`: a new one fails to compile here until it is listed there.
const _: fn(Api) = |api| match api {
    Api::ChatCompletions
    | Api::Completions
    | Api::Responses
    | Api::Embeddings
    | Api::Messages
    | Api::Converse
    | Api::GenerateContent
    | Api::StreamGenerateContent
    | Api::CountTokens => {}
};

fuzz_target!(|data: &[u8]| {
    for (path, api) in PATHS {
        let route = providers::route(path);
        // The harness reaches the API it says it does (else it fuzzes the wrong parser).
        let Some(route) = route else { panic!("{path} is not routed") };
        assert_eq!(route.api, Some(api), "{path}");
        if let Some(Ok(parsed)) = parse_on(&route, data) {
            let _ = parsed.prompt_tokens(Encoding::O200kBase);
            let _ = parsed.request.rewritten(data, true, Some(7));
        }
    }
});
