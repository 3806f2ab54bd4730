//! Reading untrusted JSON: request bodies, replies and streamed events as a flat document
//! that borrows its strings from the text, read without indexing.

use serde::de::{DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::ser::{Serialize, SerializeMap, SerializeSeq, Serializer};
use serde_json::Number;
use std::borrow::Cow;
use std::fmt;

mod scan;

/// A parsed JSON document whose strings point into the text it was parsed from (unless
/// they hold escapes), as one flat list of nodes in document order: a request body is
/// walked for its prompt without copying every string or allocating a container per
/// object and array, as a `serde_json::Value` (or a tree of `Vec`s) does. Read it through
/// [`JsonDoc::root`]'s [`Json`] views.
///
/// A container's node says where its last descendant ends, so a sibling is one step away.
/// An object's fields are its children in pairs, a key node and its value's nodes. A key
/// given twice is refused by `Json::parse_request`; elsewhere the last of a repeated key
/// wins, as in a `Value` (a `BTreeMap`): the earlier ones are marked shadowed when the
/// object closes, and neither reading nor walking sees them.
#[derive(Debug, Clone, PartialEq)]
pub struct JsonDoc<'a> {
    nodes: Vec<Node<'a>>,
}

#[derive(Debug, Clone, PartialEq)]
enum Node<'a> {
    Null,
    Bool(bool),
    Number(Number),
    String(Cow<'a, str>),
    /// `end`: the index past its last descendant.
    Array {
        end: u32,
    },
    /// `keys`: a bit for each of its keys (`key_bit`), so that asking for a key it has
    /// not (most lookups: each provider's fields are asked of every reply and event) is
    /// answered without walking its fields.
    Object {
        end: u32,
        keys: u64,
    },
    Key {
        text: Cow<'a, str>,
        shadowed: bool,
    },
}

/// A key's bit in its object's `keys`: from its length and its first and last bytes,
/// which tell apart the keys an object holds side by side in the APIs read here. A shared
/// bit only costs the walk.
fn key_bit(key: &str) -> u64 {
    let bytes = key.as_bytes();
    let (first, last) = (bytes.first().copied().unwrap_or(0), bytes.last().copied().unwrap_or(0));
    let mixed = (bytes.len() as u32).wrapping_mul(0x9e37_79b9)
        ^ u32::from(first).wrapping_mul(0x85eb_ca6b)
        ^ u32::from(last).wrapping_mul(0xc2b2_ae35);
    1 << (mixed >> 26)
}

/// The node a missing field reads as.
static NULL_NODE: [Node<'static>; 1] = [Node::Null];

/// One value of a [`JsonDoc`]: a position in its nodes, copied freely.
#[derive(Debug, Clone, Copy)]
pub struct Json<'t> {
    nodes: &'t [Node<'t>],
    at: usize,
}

/// What a value is, to match on; containers as iterators over their items or fields.
#[derive(Debug, Clone)]
pub enum Kind<'t> {
    Null,
    Bool(bool),
    Number(&'t Number),
    String(&'t str),
    Array(Items<'t>),
    Object(Fields<'t>),
}

/// Nodes a body of `len` bytes is first given room for: a chat body holds a node for every
/// 8 to 20 bytes, a streamed event one for every 6 to 8, so most documents are parsed
/// without the list growing more than once.
fn first_room(len: usize) -> usize {
    (len / 8).clamp(32, 32 * 1024)
}

impl<'a> JsonDoc<'a> {
    /// The document's value.
    pub fn root(&self) -> Json<'_> {
        if self.nodes.is_empty() {
            return Json::null();
        }
        Json { nodes: &self.nodes, at: 0 }
    }

    /// `unique`: a key given twice in an object is an error (else the last wins).
    fn parse_text(text: &'a str, unique: bool) -> Result<JsonDoc<'a>, String> {
        let mut builder = Builder { nodes: Vec::with_capacity(first_room(text.len())), unique };
        if scan::document(text, &mut builder).is_some() {
            return Ok(JsonDoc { nodes: builder.nodes });
        }
        // What the fast path gave up on, serde_json decides (and words its error).
        builder.nodes.clear();
        JsonDoc::parse_with_serde(text, builder)
    }

    fn parse_with_serde(text: &'a str, mut builder: Builder<'a>) -> Result<JsonDoc<'a>, String> {
        let mut deserializer = serde_json::Deserializer::from_str(text);
        Into(&mut builder).deserialize(&mut deserializer).map_err(|err| err.to_string())?;
        deserializer.end().map_err(|err| err.to_string())?;
        Ok(JsonDoc { nodes: builder.nodes })
    }
}

impl<'t> Json<'t> {
    /// Parses `text`, which must be UTF-8 (as JSON is): checked once for the whole text,
    /// which spares the parser checking each string it borrows.
    pub fn parse(text: &[u8]) -> Result<JsonDoc<'_>, String> {
        let text = std::str::from_utf8(text).map_err(|err| format!("not UTF-8: {err}"))?;
        JsonDoc::parse_text(text, false)
    }

    /// `parse` of text already known to be UTF-8 (a streamed event's data, say).
    pub fn parse_str(text: &str) -> Result<JsonDoc<'_>, String> {
        JsonDoc::parse_text(text, false)
    }

    /// Parses a request body as the upstreams it goes to can read it, or not at all: a
    /// leading UTF-8 byte order mark is skipped (Python's `json.loads` of bytes skips it),
    /// and a key given twice in any object is refused, since upstreams disagree on which
    /// of the two wins. What serde_json refuses (a number out of range like `1e400`, a lone
    /// surrogate escape, nesting past 128) is refused too: never read as something smaller.
    pub fn parse_request(text: &[u8]) -> Result<JsonDoc<'_>, String> {
        let text = std::str::from_utf8(text).map_err(|err| format!("not UTF-8: {err}"))?;
        let text = text.strip_prefix('\u{feff}').unwrap_or(text);
        JsonDoc::parse_text(text, true)
    }

    /// A `null` that belongs to no document: what a missing field reads as.
    pub fn null() -> Json<'static> {
        Json { nodes: &NULL_NODE, at: 0 }
    }

    fn node(self) -> &'t Node<'t> {
        self.nodes.get(self.at).unwrap_or(&Node::Null)
    }

    /// The index past this value's last node.
    fn end(self) -> usize {
        match self.node() {
            Node::Array { end } | Node::Object { end, .. } => *end as usize,
            _ => self.at + 1,
        }
    }

    pub fn kind(self) -> Kind<'t> {
        match self.node() {
            Node::Null | Node::Key { .. } => Kind::Null,
            Node::Bool(b) => Kind::Bool(*b),
            Node::Number(n) => Kind::Number(n),
            Node::String(text) => Kind::String(text),
            Node::Array { end } => Kind::Array(Items { nodes: self.nodes, next: self.at + 1, end: *end as usize }),
            Node::Object { end, .. } => {
                Kind::Object(Fields { nodes: self.nodes, next: self.at + 1, end: *end as usize })
            }
        }
    }

    /// The field `key`, or `null` when it is missing or `self` is not an object.
    pub fn at(self, key: &str) -> Json<'t> {
        self.get(key).unwrap_or(Json::null())
    }

    pub fn get(self, key: &str) -> Option<Json<'t>> {
        if let Node::Object { keys, .. } = self.node() {
            if keys & key_bit(key) == 0 {
                return None;
            }
        }
        let mut fields = self.as_object()?;
        fields.find(|(name, _)| *name == key).map(|(_, value)| value)
    }

    pub fn as_str(self) -> Option<&'t str> {
        match self.node() {
            Node::String(text) => Some(text),
            _ => None,
        }
    }

    pub fn as_bool(self) -> Option<bool> {
        match self.node() {
            Node::Bool(b) => Some(*b),
            _ => None,
        }
    }

    pub fn as_u64(self) -> Option<u64> {
        match self.node() {
            Node::Number(n) => n.as_u64(),
            _ => None,
        }
    }

    pub fn as_f64(self) -> Option<f64> {
        match self.node() {
            Node::Number(n) => n.as_f64(),
            _ => None,
        }
    }

    pub fn as_array(self) -> Option<Items<'t>> {
        match self.kind() {
            Kind::Array(items) => Some(items),
            _ => None,
        }
    }

    /// The fields in the body's order, a repeated key's earlier values left out.
    pub fn as_object(self) -> Option<Fields<'t>> {
        match self.kind() {
            Kind::Object(fields) => Some(fields),
            _ => None,
        }
    }

    pub fn is_object(self) -> bool {
        matches!(self.node(), Node::Object { .. })
    }

    pub fn is_null(self) -> bool {
        matches!(self.node(), Node::Null)
    }

    /// Compact JSON text, as `serde_json::Value`'s `to_string` writes it (objects' keys
    /// sorted: the text counted for a schema is the same whatever order the client wrote).
    pub fn to_json_string(self) -> String {
        serde_json::to_string(&self).unwrap_or_default()
    }
}

/// An array's items.
#[derive(Debug, Clone)]
pub struct Items<'t> {
    nodes: &'t [Node<'t>],
    next: usize,
    end: usize,
}

impl<'t> Iterator for Items<'t> {
    type Item = Json<'t>;

    fn next(&mut self) -> Option<Json<'t>> {
        if self.next >= self.end {
            return None;
        }
        let item = Json { nodes: self.nodes, at: self.next };
        self.next = item.end();
        Some(item)
    }
}

/// An object's fields, as (key, value), a repeated key's earlier values left out.
#[derive(Debug, Clone)]
pub struct Fields<'t> {
    nodes: &'t [Node<'t>],
    next: usize,
    end: usize,
}

impl<'t> Iterator for Fields<'t> {
    type Item = (&'t str, Json<'t>);

    fn next(&mut self) -> Option<(&'t str, Json<'t>)> {
        while self.next < self.end {
            let key = self.nodes.get(self.next)?;
            let value = Json { nodes: self.nodes, at: self.next + 1 };
            self.next = value.end();
            match key {
                Node::Key { text, shadowed: false } => return Some((text, value)),
                _ => continue,
            }
        }
        None
    }
}

/// Builds a [`JsonDoc`] as serde_json reads the text.
struct Builder<'a> {
    nodes: Vec<Node<'a>>,
    /// A key given twice in an object is an error (a request body), else the last wins.
    unique: bool,
}

impl<'a> Builder<'a> {
    fn push(&mut self, node: Node<'a>) -> usize {
        self.nodes.push(node);
        self.nodes.len() - 1
    }

    /// The end of the container at `at`, now that its last descendant is in.
    fn close(&mut self, at: usize) {
        let end = u32::try_from(self.nodes.len()).unwrap_or(u32::MAX);
        if let Some(Node::Array { end: e } | Node::Object { end: e, .. }) = self.nodes.get_mut(at) {
            *e = end;
        }
    }

    fn key_text(&self, at: usize) -> &str {
        match self.nodes.get(at) {
            Some(Node::Key { text, .. }) => text,
            _ => "",
        }
    }

    /// The positions of the keys of the object at `at`, in order.
    fn key_positions(&self, at: usize) -> impl Iterator<Item = usize> + Clone + '_ {
        let end = match self.nodes.get(at) {
            Some(Node::Object { end, .. }) => *end as usize,
            _ => at,
        };
        let mut next = at + 1;
        std::iter::from_fn(move || {
            let key = next;
            (key < end).then(|| {
                next = Json { nodes: &self.nodes, at: key + 1 }.end();
                key
            })
        })
    }

    /// The keys of the object at `at`, which just closed, kept as its key bits; a repeat
    /// is an error (`unique`), or its earlier occurrences are shadowed. A small object's
    /// keys are compared pairwise, in place; a large one's through a sorted list, so a
    /// body of many keys costs n log n.
    fn check_keys(&mut self, at: usize) -> Result<(), String> {
        // The object's key bits, and whether two keys share one: where none do, no key
        // can repeat, and the keys need no comparing.
        let (mut bits, mut shared) = (0u64, false);
        for key in self.key_positions(at) {
            let bit = key_bit(self.key_text(key));
            shared |= bits & bit != 0;
            bits |= bit;
        }
        if let Some(Node::Object { keys, .. }) = self.nodes.get_mut(at) {
            *keys = bits;
        }
        if !shared {
            return Ok(());
        }
        let keys = self.key_positions(at);
        let mut repeats: Vec<usize> = Vec::new();
        if keys.clone().nth(16).is_none() {
            let mut rest = keys;
            while let Some(earlier) = rest.next() {
                let text = self.key_text(earlier);
                if rest.clone().any(|later| self.key_text(later) == text) {
                    repeats.push(earlier);
                }
            }
        } else {
            let mut sorted: Vec<usize> = keys.collect();
            sorted.sort_unstable_by(|&a, &b| self.key_text(a).cmp(self.key_text(b)).then(a.cmp(&b)));
            for pair in sorted.windows(2) {
                if let [earlier, later] = pair {
                    if self.key_text(*earlier) == self.key_text(*later) {
                        repeats.push(*earlier);
                    }
                }
            }
        }
        if let (true, Some(&first)) = (self.unique, repeats.first()) {
            return Err(format!("the key {:?} is given twice", self.key_text(first)));
        }
        for at in repeats {
            if let Some(Node::Key { shadowed, .. }) = self.nodes.get_mut(at) {
                *shadowed = true;
            }
        }
        Ok(())
    }
}

/// Reads one value into the builder.
struct Into<'b, 'a>(&'b mut Builder<'a>);

impl<'de: 'a, 'a> DeserializeSeed<'de> for Into<'_, 'a> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de: 'a, 'a> Visitor<'de> for Into<'_, 'a> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_unit<E>(self) -> Result<(), E> {
        self.0.push(Node::Null);
        Ok(())
    }

    fn visit_none<E>(self) -> Result<(), E> {
        self.0.push(Node::Null);
        Ok(())
    }

    fn visit_bool<E>(self, b: bool) -> Result<(), E> {
        self.0.push(Node::Bool(b));
        Ok(())
    }

    fn visit_u64<E>(self, n: u64) -> Result<(), E> {
        self.0.push(Node::Number(n.into()));
        Ok(())
    }

    fn visit_i64<E>(self, n: i64) -> Result<(), E> {
        self.0.push(Node::Number(n.into()));
        Ok(())
    }

    fn visit_f64<E>(self, n: f64) -> Result<(), E> {
        self.0.push(Number::from_f64(n).map_or(Node::Null, Node::Number));
        Ok(())
    }

    fn visit_borrowed_str<E>(self, text: &'de str) -> Result<(), E> {
        self.0.push(Node::String(Cow::Borrowed(text)));
        Ok(())
    }

    fn visit_str<E>(self, text: &str) -> Result<(), E> {
        self.0.push(Node::String(Cow::Owned(text.to_string())));
        Ok(())
    }

    fn visit_string<E>(self, text: String) -> Result<(), E> {
        self.0.push(Node::String(Cow::Owned(text)));
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let at = self.0.push(Node::Array { end: 0 });
        while seq.next_element_seed(Into(&mut *self.0))?.is_some() {}
        self.0.close(at);
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let at = self.0.push(Node::Object { end: 0, keys: 0 });
        while map.next_key_seed(KeyInto(&mut *self.0))?.is_some() {
            map.next_value_seed(Into(&mut *self.0))?;
        }
        self.0.close(at);
        self.0.check_keys(at).map_err(serde::de::Error::custom)
    }
}

/// Reads an object key into the builder, borrowed from the text where it holds no escapes.
struct KeyInto<'b, 'a>(&'b mut Builder<'a>);

impl<'de: 'a, 'a> DeserializeSeed<'de> for KeyInto<'_, 'a> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl<'de: 'a, 'a> Visitor<'de> for KeyInto<'_, 'a> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an object key")
    }

    fn visit_borrowed_str<E>(self, text: &'de str) -> Result<(), E> {
        self.key(Cow::Borrowed(text));
        Ok(())
    }

    fn visit_str<E>(self, text: &str) -> Result<(), E> {
        self.key(Cow::Owned(text.to_string()));
        Ok(())
    }
}

impl<'a> KeyInto<'_, 'a> {
    fn key(self, text: Cow<'a, str>) {
        self.0.push(Node::Key { text, shadowed: false });
    }
}

impl Serialize for Json<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self.kind() {
            Kind::Null => serializer.serialize_unit(),
            Kind::Bool(b) => serializer.serialize_bool(b),
            Kind::Number(n) => n.serialize(serializer),
            Kind::String(text) => serializer.serialize_str(text),
            Kind::Array(items) => {
                let mut seq = serializer.serialize_seq(None)?;
                for item in items {
                    seq.serialize_element(&item)?;
                }
                seq.end()
            }
            Kind::Object(fields) => {
                let mut fields: Vec<(&str, Json)> = fields.collect();
                fields.sort_unstable_by(|a, b| a.0.cmp(b.0)); // no key twice: the earlier are shadowed
                let mut map = serializer.serialize_map(Some(fields.len()))?;
                for (key, value) in fields {
                    map.serialize_entry(key, &value)?;
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
    use serde_json::Value;

    /// A Value's compact text with its objects' keys sorted: what the filter's build
    /// writes (`serde_json` without `preserve_order`, which the workspace's test build may
    /// turn on through the mock upstream).
    fn sorted_text(value: &Value) -> String {
        fn sorted(value: &Value) -> Value {
            match value {
                Value::Array(items) => Value::Array(items.iter().map(sorted).collect()),
                Value::Object(map) => {
                    let mut fields: Vec<(&String, &Value)> = map.iter().collect();
                    fields.sort_unstable_by(|a, b| a.0.cmp(b.0)); // no key twice: the earlier are shadowed
                    Value::Object(fields.into_iter().map(|(k, v)| (k.clone(), sorted(v))).collect())
                }
                other => other.clone(),
            }
        }
        sorted(value).to_string()
    }

    #[test]
    fn missing_fields_and_non_objects_read_as_null() {
        let doc = Json::parse(br#"{"a": {"b": 1}, "list": [1]}"#).expect("JSON");
        let value = doc.root();
        assert_eq!(value.at("a").at("b").as_u64(), Some(1));
        assert!(value.at("missing").at("deeper").is_null());
        assert!(value.at("list").at("b").is_null());
        let three = Json::parse(b"3").expect("JSON");
        assert!(three.root().at("x").is_null());
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
            let doc = Json::parse(body.as_bytes()).expect(body);
            let value: Value = serde_json::from_str(body).expect(body);
            assert_eq!(doc.root().to_json_string(), sorted_text(&value), "{body}");
        }
        let doc = Json::parse(br#"{"b":{"c":"d"},"a":1,"b":{"c":"e"}}"#).expect("json");
        let tree = doc.root();
        assert_eq!(tree.at("b").at("c").as_str(), Some("e"));
        assert_eq!(tree.at("a").as_u64(), Some(1));
        assert!(tree.at("missing").at("deeper").is_null());
        assert!(
            matches!(tree.at("b").at("c").node(), Node::String(Cow::Borrowed(_))),
            "strings without escapes are borrowed"
        );
        // Walking sees a repeated key once, with its last value, as a Value does.
        let fields: Vec<(&str, Option<&str>)> =
            tree.as_object().expect("object").map(|(k, v)| (k, v.at("c").as_str())).collect();
        assert_eq!(fields, [("a", None), ("b", Some("e"))]);
    }

    #[test]
    fn a_repeated_key_is_refused_in_a_request_and_the_last_wins_elsewhere() {
        for size in [3, 40] {
            let mut fields: Vec<String> = (0..size).map(|i| format!("\"k{i}\":{i}")).collect();
            fields.push("\"k1\":\"again\"".to_string());
            let body = format!("{{{}}}", fields.join(","));
            let refused = Json::parse_request(body.as_bytes()).expect_err(&body);
            assert!(refused.starts_with("the key \"k1\" is given twice"), "{refused}");
            let doc = Json::parse(body.as_bytes()).expect(&body);
            assert_eq!(doc.root().at("k1").as_str(), Some("again"), "{body}");
            assert_eq!(doc.root().as_object().map(Iterator::count), Some(size), "{body}");
        }
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

        /// The fast path's nodes and serde_json's for one text, read as a request (`unique`)
        /// or not: where the fast path reads a text, serde_json reads the same nodes.
        fn paths_agree(text: &str, unique: bool) -> Result<bool, TestCaseError> {
            let mut fast = Builder { nodes: Vec::new(), unique };
            let read = scan::document(text, &mut fast).is_some();
            let slow = JsonDoc::parse_with_serde(text, Builder { nodes: Vec::new(), unique });
            if read {
                prop_assert_eq!(Ok(&fast.nodes), slow.as_ref().map(|doc| &doc.nodes), "{:?}", text);
            }
            Ok(read)
        }

        /// `text` with a few bytes replaced, inserted or removed: broken JSON, mostly.
        fn broken(text: String, edits: Vec<(usize, u8, u8)>) -> String {
            const BYTES: &[u8] = b"{}[]:,\"\\ \n\t0123456789-+.eEtrufalsn\x01\x1fu\x7f\xc3\xa9";
            let mut bytes = text.into_bytes();
            for (at, kind, pick) in edits {
                let byte = BYTES[usize::from(pick) % BYTES.len()];
                let at = if bytes.is_empty() { 0 } else { at % bytes.len() };
                match kind % 3 {
                    0 if !bytes.is_empty() => bytes[at] = byte,
                    1 => bytes.insert(at, byte),
                    _ if !bytes.is_empty() => {
                        bytes.remove(at);
                    }
                    _ => {}
                }
            }
            String::from_utf8_lossy(&bytes).into_owned()
        }

        /// Numbers and escapes at their edges, each as a whole document and inside one.
        const EDGES: [&str; 22] = [
            "0",
            "-0",
            "00",
            "01",
            "-",
            "1.",
            ".5",
            "1e400",
            "-1e400",
            "1.5e-3",
            "2E+8",
            "18446744073709551615",
            "18446744073709551616",
            "-9223372036854775808",
            "-9223372036854775809",
            r#""\ud83d\ude00""#,
            r#""\ud83d""#,
            r#""\ude00x""#,
            r#""\u00e9\/\b\f""#,
            r#""\x""#,
            "\"tab\there\"",
            "[1,]",
        ];

        #[test]
        fn the_fast_path_reads_the_edges_as_serde_json_does() {
            for edge in EDGES {
                for text in [edge.to_string(), format!("{{\"a\": [{edge}], \"b\": {edge}}}")] {
                    paths_agree(&text, true).expect(&text);
                    paths_agree(&text, false).expect(&text);
                }
            }
            let deep = format!("{}1{}", "[".repeat(127), "]".repeat(127));
            paths_agree(&deep, false).expect("deep");
        }

        /// The value a document's walk sees: its iterators and `kind` only.
        fn as_value(json: Json) -> Value {
            match json.kind() {
                Kind::Null => Value::Null,
                Kind::Bool(b) => Value::Bool(b),
                Kind::Number(n) => Value::Number(n.clone()),
                Kind::String(text) => Value::from(text),
                Kind::Array(items) => Value::Array(items.map(as_value).collect()),
                Kind::Object(fields) => Value::Object(fields.map(|(k, v)| (k.to_string(), as_value(v))).collect()),
            }
        }

        proptest! {
            #[test]
            fn the_fast_path_reads_every_document_and_as_serde_json_does(text in json_text()) {
                prop_assert!(paths_agree(&text, false)?, "the fast path gave up on a plain document: {}", text);
                paths_agree(&text, true)?;
            }

            #[test]
            fn the_fast_path_reads_broken_documents_as_serde_json_does(
                text in json_text(),
                edits in prop::collection::vec((any::<usize>(), any::<u8>(), any::<u8>()), 1..4),
            ) {
                let text = broken(text, edits);
                paths_agree(&text, false)?;
                paths_agree(&text, true)?;
            }

            #[test]
            fn the_tree_agrees_with_a_value(text in json_text()) {
                let value: Value = serde_json::from_str(&text).expect("generated JSON");
                let doc = Json::parse(text.as_bytes()).expect("generated JSON");
                prop_assert_eq!(doc.root().to_json_string(), sorted_text(&value));
                // Walked and read by key, it holds what the Value holds.
                prop_assert_eq!(&as_value(doc.root()), &value);
                if let Some(fields) = value.as_object() {
                    for (key, field) in fields {
                        prop_assert_eq!(&as_value(doc.root().at(key)), field);
                    }
                }
                // A key it has not is missing, however its bit falls (the probes the
                // providers' readers make, and near misses of the keys it has).
                let near: Vec<String> = value.as_object().into_iter().flatten().flat_map(|(key, _)| {
                    [format!("{key}x"), format!("x{key}"), key.chars().rev().collect()]
                }).collect();
                let probes = ["usage", "model", "choices", "delta", "type", "message", "usageMetadata", "", "a"];
                for key in probes.iter().copied().chain(near.iter().map(String::as_str)) {
                    let read = doc.root().get(key).map(as_value);
                    prop_assert_eq!(read.as_ref(), value.get(key), "{}", key);
                }
            }
        }
    }
}
