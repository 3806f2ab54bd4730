//! The reading against `serde_path_to_error` over serde_json's reader, what it replaces:
//! the same config or error, to the line and column, for every fixture and thousands of
//! variations of them.

use super::*;
use crate::config::shape::Document;

fn before(bytes: &[u8]) -> Result<String, Failure> {
    let mut deserializer = serde_json::Deserializer::from_slice(bytes);
    serde_path_to_error::deserialize::<_, Document>(&mut deserializer)
        .map(|document| format!("{document:?}"))
        .map_err(|e| Failure { path: e.path().to_string(), message: e.into_inner().to_string() })
}

fn now(bytes: &[u8]) -> Result<String, Failure> {
    from_slice::<Document>(bytes).map(|document| format!("{document:?}"))
}

fn documents() -> Vec<Vec<u8>> {
    let mut documents: Vec<Vec<u8>> = crate::testing::bad_configs().into_iter().map(|f| f.config).collect();
    documents.push(
        br#"{"companion": {"upstream": "c", "token": "0123456789abcdef0123456789abcdef"},
            "limits": [{"name": "m", "tokens": 5, "window": {"calendar": "month", "time_zone": "Europe/Amsterdam"},
                        "per": {"header": "x-team"}, "fair_share": {"weights": {"a": 2}}},
                       {"name": "d", "usd": 1.5, "window": "day"}],
            "tokens": {"models": [{"match": "gpt-*", "encoding": "o200k_base", "expected_output": 10}]},
            "deployments": {"d1": "gpt-4o"}, "headers": ["openai", "ietf"]}"#
            .to_vec(),
    );
    documents
}

/// Every value's span and every member's (from its key to the end of its value), from
/// the tree: `true` for a member.
fn spans(node: &Node, out: &mut Vec<(bool, usize, usize)>) {
    match &node.kind {
        Kind::Scalar(_) => {}
        Kind::Array(elements) => elements.iter().for_each(|e| spans(e, out)),
        Kind::Object(members) => {
            for (key, key_end, value) in members {
                out.push((true, key_end - key.len() - 2, value.end));
                spans(value, out);
            }
        }
    }
    out.push((false, node.start, node.end));
}

/// The two readings agree, but where the document is not JSON and serde_json read in
/// order met a wrong type before the syntax error (the one difference, by design).
fn compare(bytes: &[u8], mismatches: &mut Vec<String>) -> bool {
    let (old, new) = (before(bytes), now(bytes));
    let syntax = <Value as de::Deserialize>::deserialize(&mut serde_json::Deserializer::from_slice(bytes)).err();
    if let (Some(syntax), Err(old)) = (syntax, &old) {
        if old.message != syntax.to_string() {
            return false;
        }
    }
    if old != new {
        mismatches.push(format!("{}\n  before: {old:?}\n  now:    {new:?}", String::from_utf8_lossy(bytes)));
    }
    true
}

/// Enough variations compared (not skipped as not JSON), none of them different.
fn agreed(count: usize, mismatches: &[String]) {
    assert!(count > 10_000, "{count} compared");
    let shown = mismatches[..mismatches.len().min(10)].join("\n");
    assert!(mismatches.is_empty(), "{} of {count}:\n{shown}", mismatches.len());
}

#[test]
fn reads_every_fixture_as_serde_path_to_error_did() {
    let mut mismatches = Vec::new();
    for document in documents() {
        assert!(compare(&document, &mut mismatches));
    }
    assert!(mismatches.is_empty(), "{}", mismatches.join("\n"));
}

/// Every variation `vary` makes of every document read alike.
fn variations_agree(vary: impl Fn(&[u8]) -> Vec<Vec<u8>>) {
    let mut mismatches = Vec::new();
    let mut count = 0;
    for document in documents() {
        for bytes in vary(&document) {
            count += usize::from(compare(&bytes, &mut mismatches));
        }
    }
    agreed(count, &mismatches);
}

/// Each value replaced by one of another type, each member misspelt or written twice.
#[test]
fn reads_wrong_types_and_keys_as_serde_path_to_error_did() {
    const VALUES: [&str; 12] =
        ["null", "true", "0", "-1", "1.5", "1e3", "\"x\"", "\"1m\"", "[]", "{}", "[\"x\"]", "{\"x\": 1}"];
    variations_agree(|document| {
        let Some(root) = (Scanner { bytes: document, at: 0 }).value() else { return Vec::new() };
        let mut found = Vec::new();
        spans(&root, &mut found);
        let mut variations = Vec::new();
        for (member, start, end) in found {
            let written = String::from_utf8_lossy(&document[start..end]);
            let replacements: Vec<String> = match member {
                true => vec![format!("\"zz\": 1, {written}"), format!("{written}, {written}")],
                false => VALUES.iter().map(|v| v.to_string()).collect(),
            };
            for replacement in replacements {
                let mut bytes = document[..start].to_vec();
                bytes.extend_from_slice(replacement.as_bytes());
                bytes.extend_from_slice(&document[end..]);
                variations.push(bytes);
            }
        }
        variations
    });
}

/// Cut short anywhere: a syntax error at the same place and on the same field.
#[test]
fn reads_truncated_documents_as_serde_path_to_error_did() {
    variations_agree(|document| (0..document.len()).map(|end| document[..end].to_vec()).collect());
}

/// A stray byte anywhere: a syntax error at the same place and on the same field.
#[test]
fn reads_stray_bytes_as_serde_path_to_error_did() {
    variations_agree(|document| {
        let strays = [b',', b'}', b']', b':', b'x', b'"', b'\\'];
        let at = 0..document.len();
        at.flat_map(|at| {
            strays.map(|stray| {
                let mut bytes = document.to_vec();
                bytes.insert(at, stray);
                bytes
            })
        })
        .collect()
    });
}
