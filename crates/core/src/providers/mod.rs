//! Providers whose paths and framings differ from OpenAI's and Anthropic's.

pub mod bedrock;
