//! Reading untrusted JSON: fields without indexing, and request bodies as a tree that
//! borrows its strings from the body.

use serde::de::{Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::ser::{Serialize, SerializeMap, SerializeSeq, Serializer};
use serde_json::{Number, Value};
use std::borrow::Cow;
use std::fmt;

static NULL: Value = Value::Null;

pub trait Field {
    /// The field `key`, or `null` when it is missing or `self` is not an object; like
    /// `value["key"]`, but written so that no reader has to wonder whether it can panic.
    fn at(&self, key: &str) -> &Value;
}

impl Field for Value {
    fn at(&self, key: &str) -> &Value {
        self.get(key).unwrap_or(&NULL)
    }
}

/// A JSON value whose strings point into the text it was parsed from (unless they hold
/// escapes): a request body is walked for its prompt without copying every string and
/// building a map per object, which a `serde_json::Value` does. Objects keep their fields
/// sorted by key, the last of a repeated key winning, so reading one is a binary search
/// and walking one sees what a `Value` (a `BTreeMap`) would see, in the same order.
#[derive(Debug, Clone, PartialEq)]
pub enum Json<'a> {
    Null,
    Bool(bool),
    Number(Number),
    String(Cow<'a, str>),
    Array(Vec<Json<'a>>),
    Object(Vec<(Cow<'a, str>, Json<'a>)>),
}

static JSON_NULL: Json<'static> = Json::Null;

impl<'a> Json<'a> {
    /// Parses `text`, which must be UTF-8 (as JSON is): checked once for the whole text,
    /// which spares the parser checking each string it borrows.
    pub fn parse(text: &'a [u8]) -> Result<Json<'a>, String> {
        let text = std::str::from_utf8(text).map_err(|err| format!("not UTF-8: {err}"))?;
        serde_json::from_str(text).map_err(|err| err.to_string())
    }

    /// Parses a request body as the upstreams it goes to can read it, or not at all: a
    /// leading UTF-8 byte order mark is skipped (Python's `json.loads` of bytes skips it),
    /// and a key given twice in any object is refused, since upstreams disagree on which
    /// of the two wins. What serde_json refuses (a number out of range like `1e400`, a lone
    /// surrogate escape, nesting past 128) is refused too: never read as something smaller.
    pub fn parse_request(text: &'a [u8]) -> Result<Json<'a>, String> {
        let text = std::str::from_utf8(text).map_err(|err| format!("not UTF-8: {err}"))?;
        let text = text.strip_prefix('\u{feff}').unwrap_or(text);
        serde_json::from_str::<Tree<'a, true>>(text).map(|tree| tree.0).map_err(|err| err.to_string())
    }

    /// The field `key`, or `null` when it is missing or `self` is not an object.
    pub fn at(&self, key: &str) -> &Json<'a> {
        self.get(key).unwrap_or(&JSON_NULL)
    }

    pub fn get(&self, key: &str) -> Option<&Json<'a>> {
        let Json::Object(fields) = self else { return None };
        let at = fields.binary_search_by(|(name, _)| name.as_ref().cmp(key)).ok()?;
        fields.get(at).map(|(_, value)| value)
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Json::String(text) => Some(text),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match self {
            Json::Bool(b) => Some(*b),
            _ => None,
        }
    }

    pub fn as_u64(&self) -> Option<u64> {
        match self {
            Json::Number(n) => n.as_u64(),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Json::Number(n) => n.as_f64(),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Json<'a>]> {
        match self {
            Json::Array(items) => Some(items),
            _ => None,
        }
    }

    pub fn as_object(&self) -> Option<&[(Cow<'a, str>, Json<'a>)]> {
        match self {
            Json::Object(fields) => Some(fields),
            _ => None,
        }
    }

    pub fn is_object(&self) -> bool {
        matches!(self, Json::Object(_))
    }

    /// Compact JSON text, as `serde_json::Value`'s `to_string` writes it.
    pub fn to_json_string(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for Json<'a> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Json<'a>, D::Error> {
        Tree::<false>::deserialize(deserializer).map(|tree| tree.0)
    }
}

/// A tree whose objects may repeat a key (the last kept) or, `UNIQUE`, may not.
struct Tree<'a, const UNIQUE: bool>(Json<'a>);

impl<'de: 'a, 'a, const UNIQUE: bool> Deserialize<'de> for Tree<'a, UNIQUE> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Tree<'a, UNIQUE>, D::Error> {
        deserializer.deserialize_any(JsonVisitor::<UNIQUE>).map(Tree)
    }
}

struct JsonVisitor<const UNIQUE: bool>;

impl<'de, const UNIQUE: bool> Visitor<'de> for JsonVisitor<UNIQUE> {
    type Value = Json<'de>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_unit<E>(self) -> Result<Json<'de>, E> {
        Ok(Json::Null)
    }

    fn visit_none<E>(self) -> Result<Json<'de>, E> {
        Ok(Json::Null)
    }

    fn visit_bool<E>(self, b: bool) -> Result<Json<'de>, E> {
        Ok(Json::Bool(b))
    }

    fn visit_u64<E>(self, n: u64) -> Result<Json<'de>, E> {
        Ok(Json::Number(n.into()))
    }

    fn visit_i64<E>(self, n: i64) -> Result<Json<'de>, E> {
        Ok(Json::Number(n.into()))
    }

    fn visit_f64<E>(self, n: f64) -> Result<Json<'de>, E> {
        Ok(Number::from_f64(n).map_or(Json::Null, Json::Number))
    }

    fn visit_borrowed_str<E>(self, text: &'de str) -> Result<Json<'de>, E> {
        Ok(Json::String(Cow::Borrowed(text)))
    }

    fn visit_str<E>(self, text: &str) -> Result<Json<'de>, E> {
        Ok(Json::String(Cow::Owned(text.to_string())))
    }

    fn visit_string<E>(self, text: String) -> Result<Json<'de>, E> {
        Ok(Json::String(Cow::Owned(text)))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Json<'de>, A::Error> {
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(64));
        while let Some(Tree(item)) = seq.next_element::<Tree<UNIQUE>>()? {
            items.push(item);
        }
        Ok(Json::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Json<'de>, A::Error> {
        let mut fields: Vec<(Cow<'de, str>, Json<'de>)> = Vec::with_capacity(map.size_hint().unwrap_or(0).min(64));
        while let Some(Key(key)) = map.next_key()? {
            let Tree(value) = map.next_value::<Tree<UNIQUE>>()?;
            fields.push((key, value));
        }
        // Sorted, the last of a repeated key kept: what a BTreeMap built in order holds.
        if !fields.is_sorted_by(|a, b| a.0 < b.0) {
            fields.sort_by(|a, b| a.0.cmp(&b.0)); // stable: repeats stay in body order
            let mut kept: Vec<(Cow<'de, str>, Json<'de>)> = Vec::with_capacity(fields.len());
            for field in fields {
                match kept.last_mut() {
                    Some(last) if last.0 == field.0 && UNIQUE => {
                        return Err(serde::de::Error::custom(format!("the key {:?} is given twice", field.0)));
                    }
                    Some(last) if last.0 == field.0 => *last = field,
                    _ => kept.push(field),
                }
            }
            fields = kept;
        }
        Ok(Json::Object(fields))
    }
}

/// An object key, borrowed from the text where it holds no escapes.
struct Key<'a>(Cow<'a, str>);

impl<'de: 'a, 'a> Deserialize<'de> for Key<'a> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Key<'a>, D::Error> {
        struct KeyVisitor;
        impl<'de> Visitor<'de> for KeyVisitor {
            type Value = Key<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an object key")
            }
            fn visit_borrowed_str<E>(self, text: &'de str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Borrowed(text)))
            }
            fn visit_str<E>(self, text: &str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Owned(text.to_string())))
            }
        }
        deserializer.deserialize_str(KeyVisitor)
    }
}

impl Serialize for Json<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Json::Null => serializer.serialize_unit(),
            Json::Bool(b) => serializer.serialize_bool(*b),
            Json::Number(n) => n.serialize(serializer),
            Json::String(text) => serializer.serialize_str(text),
            Json::Array(items) => {
                let mut seq = serializer.serialize_seq(Some(items.len()))?;
                for item in items {
                    seq.serialize_element(item)?;
                }
                seq.end()
            }
            Json::Object(fields) => {
                let mut map = serializer.serialize_map(Some(fields.len()))?;
                for (key, value) in fields {
                    map.serialize_entry(key.as_ref(), value)?;
                }
                map.end()
            }
        }
    }
}

/// One byte of a JSON string's text, for scanners that follow a document byte by byte:
/// whether it closes the string. `escaped` carries a backslash over to the next byte.
pub(crate) fn closes_string(escaped: &mut bool, byte: u8) -> bool {
    if *escaped {
        *escaped = false;
        false
    } else if byte == b'\\' {
        *escaped = true;
        false
    } else {
        byte == b'"'
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A Value's compact text with its objects' keys sorted: what the filter's build
    /// writes (`serde_json` without `preserve_order`, which the workspace's test build may
    /// turn on through the mock upstream).
    fn sorted_text(value: &Value) -> String {
        fn sorted(value: &Value) -> Value {
            match value {
                Value::Array(items) => Value::Array(items.iter().map(sorted).collect()),
                Value::Object(map) => {
                    let mut fields: Vec<(&String, &Value)> = map.iter().collect();
                    fields.sort_by(|a, b| a.0.cmp(b.0));
                    Value::Object(fields.into_iter().map(|(k, v)| (k.clone(), sorted(v))).collect())
                }
                other => other.clone(),
            }
        }
        sorted(value).to_string()
    }

    #[test]
    fn missing_fields_and_non_objects_read_as_null() {
        let value: Value = serde_json::json!({"a": {"b": 1}, "list": [1]});
        assert_eq!(value.at("a").at("b"), &Value::from(1));
        assert!(value.at("missing").at("deeper").is_null());
        assert!(value.at("list").at("b").is_null());
        assert!(Value::from(3).at("x").is_null());
    }

    #[test]
    fn the_borrowed_tree_reads_and_writes_as_a_value_does() {
        let bodies = [
            r#"{"b":1,"a":[true,null,"x\"y",2.5,-3,1e300],"c":{"z":{},"y":[]},"a":"last wins"}"#,
            r#"{"k\u00e9y":"caf\u00e9","emoji":"😀","ctl":"\u0001\n","n":18446744073709551615}"#,
            r#"[{"x":1,"x":2,"x":3},"s",0.1]"#,
            r#""just a string""#,
        ];
        for body in bodies {
            let tree = Json::parse(body.as_bytes()).expect(body);
            let value: Value = serde_json::from_str(body).expect(body);
            assert_eq!(tree.to_json_string(), sorted_text(&value), "{body}");
        }
        let tree = Json::parse(br#"{"b":{"c":"d"},"a":1,"b":{"c":"e"}}"#).expect("json");
        assert_eq!(tree.at("b").at("c").as_str(), Some("e"));
        assert_eq!(tree.at("a").as_u64(), Some(1));
        assert_eq!(tree.at("missing").at("deeper"), &Json::Null);
        assert!(matches!(tree.at("b").at("c"), Json::String(Cow::Borrowed(_))), "strings without escapes are borrowed");
    }

    #[test]
    fn deep_or_broken_bodies_are_errors() {
        assert!(Json::parse(b"{oops").is_err());
        let deep = "[".repeat(100_000);
        assert!(Json::parse(deep.as_bytes()).is_err(), "nesting is limited as for a Value");
    }

    #[cfg(not(target_arch = "wasm32"))]
    mod generated {
        use super::*;
        use proptest::prelude::*;

        /// JSON text with repeated keys, escapes, odd numbers and nesting: the tree must
        /// read it as a `Value` does.
        fn json_text() -> impl Strategy<Value = String> {
            let leaf = prop_oneof![
                Just("null".to_string()),
                any::<bool>().prop_map(|b| b.to_string()),
                any::<i64>().prop_map(|n| n.to_string()),
                any::<f64>().prop_filter("finite", |f| f.is_finite()).prop_map(|f| format!("{f:e}")),
                "[a-c\\\"é😀\n ]{0,6}".prop_map(|s| serde_json::to_string(&s).unwrap_or_default()),
                Just(r#""\u00e9\t\/""#.to_string()),
            ];
            leaf.prop_recursive(4, 48, 6, |inner| {
                prop_oneof![
                    prop::collection::vec(inner.clone(), 0..6).prop_map(|items| format!("[{}]", items.join(","))),
                    prop::collection::vec(("[abc]{1,2}", inner), 0..6).prop_map(|fields| {
                        let fields: Vec<String> = fields.into_iter().map(|(k, v)| format!("\"{k}\":{v}")).collect();
                        format!("{{{}}}", fields.join(","))
                    }),
                ]
            })
        }

        proptest! {
            #[test]
            fn the_tree_agrees_with_a_value(text in json_text()) {
                let value: Value = serde_json::from_str(&text).expect("generated JSON");
                let tree = Json::parse(text.as_bytes()).expect("generated JSON");
                prop_assert_eq!(tree.to_json_string(), sorted_text(&value));
            }
        }
    }
}
