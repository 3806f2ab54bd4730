//! Each request's record, published to the host once the request is settled or refused,
//! so the proxy's own access log can say who used what and how it was decided: on Envoy
//! as filter state (`%FILTER_STATE(wasm.llm_ratelimit:PLAIN)%`, CEL
//! `filter_state['wasm.llm_ratelimit']`), on ngx_wasm_module as Nginx variables
//! (`$llm_ratelimit`, declared with `set`). Through the standard `proxy_set_property`.
//!
//! The tenant is its id (a hash of the key, never the key); the token counts are the ones
//! the settlement charged (the reply's usage, or the least a reply the filter could not
//! read is charged), the cost what a cost limit was charged for them.

use crate::api::Api;
use crate::config::RecordMode;
use crate::effects::host::{Host, HostKind};
use crate::providers::Provider;
use std::fmt::Write;

/// The JSON record's property, and the prefix of each field's own.
pub const RECORD_PROPERTY: &str = "llm_ratelimit";

/// Every field's property name (`RecordMode::Fields`), for `check-config` and the docs.
pub const FIELD_PROPERTIES: [&str; 15] = [
    "llm_ratelimit_tenant",
    "llm_ratelimit_owners",
    "llm_ratelimit_provider",
    "llm_ratelimit_api",
    "llm_ratelimit_model",
    "llm_ratelimit_input_tokens",
    "llm_ratelimit_output_tokens",
    "llm_ratelimit_cached_tokens",
    "llm_ratelimit_reasoning_tokens",
    "llm_ratelimit_cost_micro_usd",
    "llm_ratelimit_decision",
    "llm_ratelimit_refused_by",
    "llm_ratelimit_queued_ms",
    "llm_ratelimit_overflow",
    "llm_ratelimit_shadow",
];

/// How a request was decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum How {
    /// No limit applied to it (a path no limit reads, a bypassed request).
    #[default]
    Unlimited,
    /// Charged in Redis through the companion.
    Charged,
    /// Taken from this proxy's lease of a budget.
    Leased,
    /// Charged in this proxy's local store (`store: local`).
    LocalStore,
    /// Decided by the degraded mode's local share while the companion was away.
    Degraded,
    /// Let through unlimited while the companion was away (`failure_mode: allow`).
    DegradedAllowed,
    /// Refused (by `refused_by`, when a limit refused it).
    Refused,
    /// Refused: an owner's plan suspends it (`refused_by`: the limit it came through).
    Suspended,
}

impl How {
    pub fn name(self) -> &'static str {
        match self {
            How::Unlimited => "unlimited",
            How::Charged => "charge",
            How::Leased => "lease",
            How::LocalStore => "local_store",
            How::Degraded => "degraded",
            How::DegradedAllowed => "degraded_allow",
            How::Refused => "refused",
            How::Suspended => "suspended",
        }
    }
}

/// What one request used and cost, as settled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Used {
    pub input: u64,
    pub output: u64,
    pub cached: u64,
    pub reasoning: u64,
    pub cost_micro_usd: u64,
}

/// One request's record.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Record<'a> {
    pub tenant: &'a str,
    /// Each pool's claimant charged (`per` header values), by limit name.
    pub owners: Vec<(&'a str, &'a str)>,
    pub provider: Option<Provider>,
    pub api: Option<Api>,
    pub model: &'a str,
    pub used: Used,
    pub how: How,
    /// The limit that refused it (or, in shadow mode, would have).
    pub refused_by: Option<&'a str>,
    pub queued_ms: u64,
    /// The backend it overflowed to.
    pub overflow: Option<&'a str>,
    /// Refused, and let through by shadow mode.
    pub shadow: bool,
}

fn provider_name(provider: Provider) -> &'static str {
    match provider {
        Provider::OpenAi => "openai",
        Provider::Anthropic => "anthropic",
        Provider::Gemini => "gemini",
        Provider::Azure => "azure",
        Provider::Bedrock => "bedrock",
    }
}

fn api_name(api: Api) -> &'static str {
    match api {
        Api::ChatCompletions => "chat_completions",
        Api::Completions => "completions",
        Api::Responses => "responses",
        Api::Embeddings => "embeddings",
        Api::Messages => "messages",
        Api::Converse => "converse",
        Api::GenerateContent => "generate_content",
        Api::StreamGenerateContent => "stream_generate_content",
        Api::CountTokens => "count_tokens",
    }
}

impl Record<'_> {
    /// The owners as `limit=value` pairs joined by `,`.
    fn owners_text(&self) -> String {
        let mut text = String::new();
        for (i, (limit, owner)) in self.owners.iter().enumerate() {
            if i > 0 {
                text.push(',');
            }
            let _ = write!(text, "{limit}={owner}");
        }
        text
    }

    /// Each field's property name and value, in `FIELD_PROPERTIES`' order.
    pub fn fields(&self) -> [(&'static str, String); 15] {
        let text = |value: Option<&str>| value.unwrap_or("").to_string();
        let [tenant, owners, provider, api, model, input, output, cached, reasoning, cost, decision, refused_by, queued, overflow, shadow] =
            FIELD_PROPERTIES;
        [
            (tenant, self.tenant.to_string()),
            (owners, self.owners_text()),
            (provider, text(self.provider.map(provider_name))),
            (api, text(self.api.map(api_name))),
            (model, self.model.to_string()),
            (input, self.used.input.to_string()),
            (output, self.used.output.to_string()),
            (cached, self.used.cached.to_string()),
            (reasoning, self.used.reasoning.to_string()),
            (cost, self.used.cost_micro_usd.to_string()),
            (decision, self.how.name().to_string()),
            (refused_by, text(self.refused_by)),
            (queued, self.queued_ms.to_string()),
            (overflow, text(self.overflow)),
            (shadow, self.shadow.to_string()),
        ]
    }

    /// The record as one JSON object (fields named without the prefix), keys in order.
    pub fn json(&self) -> String {
        let mut out = String::new();
        self.write_json(&mut out);
        out
    }

    /// Writes [`Record::json`] into `out`, in one allocation at most: every request
    /// publishes it, so it is written by pieces (the keys between the values as one
    /// literal each, numbers by `itoa`), never through `format!`'s machinery, and the
    /// owners in their keys' order without a sorted copy.
    pub fn write_json(&self, out: &mut String) {
        let texts = [Some(self.tenant), Some(self.model), self.refused_by, self.overflow];
        let owners: usize = self.owners.iter().map(|(limit, owner)| limit.len() + owner.len() + 6).sum();
        // The keys, the names and every number at its longest, and the texts unescaped:
        // only escapes can outgrow it.
        out.reserve(330 + owners + texts.iter().map(|t| t.map_or(0, str::len)).sum::<usize>());
        let mut digits = itoa::Buffer::new();
        out.push_str("{\"api\":");
        push_name(out, self.api.map(api_name));
        out.push_str(",\"cached_tokens\":");
        out.push_str(digits.format(self.used.cached));
        out.push_str(",\"cost_micro_usd\":");
        out.push_str(digits.format(self.used.cost_micro_usd));
        out.push_str(",\"decision\":\"");
        out.push_str(self.how.name());
        out.push_str("\",\"input_tokens\":");
        out.push_str(digits.format(self.used.input));
        out.push_str(",\"model\":");
        push_text(out, Some(self.model));
        out.push_str(",\"output_tokens\":");
        out.push_str(digits.format(self.used.output));
        out.push_str(",\"overflow\":");
        push_text(out, self.overflow);
        out.push_str(",\"owners\":{");
        // In order of the limits' names (unique in a config): each time the least name
        // after the last one written.
        let mut last: Option<&str> = None;
        for i in 0..self.owners.len() {
            let next = self.owners.iter().filter(|(limit, _)| last.is_none_or(|last| *limit > last)).min();
            let Some((limit, owner)) = next else { break };
            if i > 0 {
                out.push(',');
            }
            push_text(out, Some(limit));
            out.push(':');
            push_text(out, Some(owner));
            last = Some(limit);
        }
        out.push_str("},\"provider\":");
        push_name(out, self.provider.map(provider_name));
        out.push_str(",\"queued_ms\":");
        out.push_str(digits.format(self.queued_ms));
        out.push_str(",\"reasoning_tokens\":");
        out.push_str(digits.format(self.used.reasoning));
        out.push_str(",\"refused_by\":");
        push_text(out, self.refused_by);
        out.push_str(if self.shadow { ",\"shadow\":true,\"tenant\":" } else { ",\"shadow\":false,\"tenant\":" });
        push_text(out, Some(self.tenant));
        out.push('}');
    }
}

/// One of the record's own names (no character in them needs an escape) as a JSON
/// string, `null` for none.
fn push_name(out: &mut String, name: Option<&'static str>) {
    match name {
        Some(name) => {
            out.push('"');
            out.push_str(name);
            out.push('"');
        }
        None => out.push_str("null"),
    }
}

/// Whether JSON needs `byte` escaped in a string: quotes, backslashes and control
/// characters. Every other byte, those of multi-byte characters included, is copied.
fn needs_escape(byte: u8) -> bool {
    byte < 0x20 || byte == b'"' || byte == b'\\'
}

/// `text` as a JSON string (`null` for none): quotes, backslashes and control characters
/// escaped, since a model name is the client's to choose.
fn push_text(out: &mut String, text: Option<&str>) {
    let Some(text) = text else {
        out.push_str("null");
        return;
    };
    out.push('"');
    // Most texts need no escape: looked for over the whole text at once (a loop without
    // an early exit, which the compiler can widen), then copied whole.
    if !text.bytes().fold(false, |any, byte| any | needs_escape(byte)) {
        out.push_str(text);
        out.push('"');
        return;
    }
    // Runs of text that need no escape are copied whole (a byte that does is ASCII, never
    // inside a multi-byte character, so every run is whole characters).
    let mut run = 0;
    for (at, byte) in text.bytes().enumerate() {
        let escape = match byte {
            b'"' => "\\\"",
            b'\\' => "\\\\",
            b'\n' => "\\n",
            b'\r' => "\\r",
            b'\t' => "\\t",
            byte if byte < 0x20 => "",
            _ => continue,
        };
        out.push_str(text.get(run..at).unwrap_or_default());
        run = at + 1;
        match escape {
            "" => {
                const HEX: &[u8; 16] = b"0123456789abcdef";
                out.push_str("\\u00");
                for digit in [byte >> 4, byte & 0xf] {
                    out.push(char::from(HEX.get(usize::from(digit)).copied().unwrap_or(b'0')));
                }
            }
            escape => out.push_str(escape),
        }
    }
    out.push_str(text.get(run..).unwrap_or_default());
    out.push('"');
}

/// Sets the property named `name` where it lives on `kind`: Envoy keeps it as filter
/// state (`wasm.<name>`); ngx_wasm_module sets the Nginx variable `$<name>` for
/// `ngx.<name>`.
fn set_property(host: &mut impl Host, kind: HostKind, name: &str, value: &[u8]) -> bool {
    match kind {
        HostKind::Envoy => host.set_property(&[name], value),
        HostKind::Nginx => host.set_property(&["ngx", name], value),
    }
}

/// Publishes `record` as `mode` says; says once in the log when the host refuses (on
/// Nginx, a variable the config does not declare with `set`).
pub fn publish(host: &mut impl Host, kind: HostKind, mode: RecordMode, record: &Record) {
    let mut refused = None;
    if matches!(mode, RecordMode::Json | RecordMode::Both)
        && !set_property(host, kind, RECORD_PROPERTY, record.json().as_bytes())
    {
        refused = Some(RECORD_PROPERTY);
    }
    if matches!(mode, RecordMode::Fields | RecordMode::Both) {
        for (name, value) in record.fields() {
            if !set_property(host, kind, name, value.as_bytes()) {
                refused = refused.or(Some(name));
            }
        }
    }
    if let Some(name) = refused {
        let hint = match kind {
            HostKind::Nginx => format!(" (declare it: `set ${name} \"\";` where the filter runs)"),
            HostKind::Envoy => String::new(),
        };
        host.warn_once(
            "record",
            &format!("llm-ratelimit: the host refused the request record's property {name}{hint}"),
        );
    }
}

#[cfg(all(test, not(target_arch = "wasm32")))]
mod text_tests {
    use super::push_text;
    use proptest::prelude::*;

    fn json_text(text: &str) -> String {
        let mut out = String::new();
        push_text(&mut out, Some(text));
        out
    }

    #[test]
    fn a_text_is_a_json_string_of_itself() {
        assert_eq!(json_text("gpt-4o"), "\"gpt-4o\"");
        assert_eq!(json_text("a\"b\\c\nd\re\tf\u{1}g\u{1f}é😀"), "\"a\\\"b\\\\c\\nd\\re\\tf\\u0001g\\u001fé😀\"");
        assert_eq!(json_text(""), "\"\"");
    }

    proptest! {
        #[test]
        fn any_text_reads_back_as_written(text in any::<String>()) {
            let read: String = serde_json::from_str(&json_text(&text)).expect("JSON");
            prop_assert_eq!(read, text);
        }
    }
}

/// The record as the access log reads it, byte for byte, against `record.golden`: nulls,
/// owners out of order, every decision, escapes, non-ASCII and the largest numbers, as
/// JSON and as fields. A change to what operators' log pipelines parse fails here.
#[cfg(all(test, not(target_arch = "wasm32")))]
mod golden_tests {
    use super::*;

    fn records() -> Vec<(&'static str, Record<'static>)> {
        let full = Record {
            tenant: "t-4f2a9c01",
            owners: vec![("team-tpm", "x-team=research"), ("org-rpm", "x-org=acme"), ("user-rpd", "u-17")],
            provider: Some(Provider::OpenAi),
            api: Some(Api::ChatCompletions),
            model: "gpt-4o-mini",
            used: Used { input: 12, output: 8, cached: 3, reasoning: 2, cost_micro_usd: 433 },
            how: How::Leased,
            refused_by: None,
            queued_ms: 250,
            overflow: None,
            shadow: false,
        };
        let mut out = vec![("nothing known", Record::default()), ("leased, three owners", full.clone())];
        let providers = [Provider::OpenAi, Provider::Anthropic, Provider::Gemini, Provider::Azure, Provider::Bedrock];
        let apis = [
            Api::ChatCompletions,
            Api::Completions,
            Api::Responses,
            Api::Embeddings,
            Api::Messages,
            Api::Converse,
            Api::GenerateContent,
            Api::StreamGenerateContent,
            Api::CountTokens,
        ];
        let hows = [
            How::Unlimited,
            How::Charged,
            How::Leased,
            How::LocalStore,
            How::Degraded,
            How::DegradedAllowed,
            How::Refused,
            How::Suspended,
        ];
        for (i, how) in hows.into_iter().enumerate() {
            out.push((
                "each decision, provider and API",
                Record {
                    how,
                    provider: providers.get(i % providers.len()).copied(),
                    api: apis.get(i).copied(),
                    owners: Vec::new(),
                    ..full.clone()
                },
            ));
        }
        out.push((
            "refused in shadow mode, overflowed",
            Record {
                how: How::Refused,
                refused_by: Some("org-rpm"),
                overflow: Some("backup-cluster"),
                shadow: true,
                api: Some(Api::CountTokens),
                ..full.clone()
            },
        ));
        out.push((
            "escapes and non-ASCII",
            Record {
                tenant: "t-\u{7f}\u{80}",
                owners: vec![("pool \"q\"", "x-user=a\\b\tc"), ("ünï", "名前\u{1}\u{1f}")],
                model: "gpt\"4o\\mini\n\r\t\u{0}\u{8}\u{c}\u{1b}é😀\u{2028}\u{2029}",
                refused_by: Some("quote\"d"),
                overflow: Some("back\\slash"),
                ..full.clone()
            },
        ));
        out.push((
            "the largest numbers",
            Record {
                used: Used {
                    input: u64::MAX,
                    output: u64::MAX - 1,
                    cached: 10_000_000_000,
                    reasoning: 1,
                    cost_micro_usd: u64::MAX,
                },
                queued_ms: u64::MAX,
                ..full
            },
        ));
        out
    }

    #[test]
    fn the_record_is_unchanged_to_the_byte() {
        let mut text = String::new();
        for (what, record) in records() {
            text.push_str(&format!("== {what}\n{}\n", record.json()));
            for (name, value) in record.fields() {
                text.push_str(&format!("{name}={value:?}\n"));
            }
        }
        let golden = include_str!("record.golden");
        if golden != text {
            let _ = std::fs::write(concat!(env!("CARGO_MANIFEST_DIR"), "/src/lifecycle/record.golden.new"), &text);
        }
        assert!(golden == text, "the record changed: see src/lifecycle/record.golden.new");
    }

    #[test]
    fn the_record_is_json_of_its_fields() {
        for (what, record) in records() {
            let read: serde_json::Value = serde_json::from_str(&record.json()).expect(what);
            assert_eq!(read["model"], record.model, "{what}");
            assert_eq!(read["tenant"], record.tenant, "{what}");
            for (limit, owner) in &record.owners {
                assert_eq!(read["owners"][*limit], *owner, "{what}");
            }
        }
    }
}
