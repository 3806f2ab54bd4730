//! Reads the config's JSON into its shape, an error naming the field at fault (as a path,
//! `limits[0].window`) and where it is (`at line 13 column 5`).
//!
//! The JSON is parsed once into a tree that remembers where each value ends, and the
//! shape's `Deserialize` code runs over that tree with this module's deserializer, which
//! tracks the path itself. The shape's code is so built once, for one deserializer: a
//! tracking wrapper around serde_json's own (what `serde_path_to_error` is) put a second
//! layer of generic code around every field of every section, and the filter compiles
//! all of that at start-up (issue 48).
//!
//! The errors are the ones serde_json and `serde_path_to_error` gave, word for word and
//! at the same line and column (the config tests compare them with both): an error is
//! placed where serde_json's reader stood when it raised or first passed it, which this
//! deserializer knows from the tree's offsets, and its path is the innermost value it
//! arose in. One difference: a config that is not JSON is refused for that first (with
//! serde_json's own message, at the field it is in), where serde_json read in order could
//! meet a wrong type earlier in the text.

use serde::de::Error as _;
use serde::de::{self, DeserializeSeed, Deserializer, EnumAccess, MapAccess, SeqAccess, VariantAccess, Visitor};
use serde_json::Value;
use std::cell::Cell;
use std::fmt;

/// Why a config could not be read: the field's path (`.` for the whole document) and
/// serde's message, with its line and column where known.
#[derive(Debug, PartialEq, Eq)]
pub struct Failure {
    pub path: String,
    pub message: String,
}

/// `bytes` as a `T`, or what is wrong and where.
pub fn from_slice<T: de::DeserializeOwned>(bytes: &[u8]) -> Result<T, Failure> {
    // serde_json's reader on the document's one value (what follows it is not read, as
    // before: a config is one JSON value), for its syntax errors.
    if let Err(e) = <Value as de::Deserialize>::deserialize(&mut serde_json::Deserializer::from_slice(bytes)) {
        let at = offset(bytes, e.line(), e.column());
        return Err(Failure { path: syntax_path(bytes, at), message: e.to_string() });
    }
    let unreadable = || Failure { path: ".".to_string(), message: "unreadable JSON".to_string() };
    let mut scanner = Scanner { bytes, at: 0 };
    let root = scanner.value().ok_or_else(unreadable)?;
    T::deserialize(Reader { node: &root, path: Path::Root, bytes }).map_err(|e| {
        let e = *e.0;
        Failure {
            path: e.path.unwrap_or_else(|| Path::Root.render()),
            message: match e.at {
                Some(at) => {
                    let (line, column) = line_column(bytes, at);
                    format!("{} at line {line} column {column}", e.message)
                }
                None => e.message,
            },
        }
    })
}

/// A value of the document and where it is: `start` its first byte, `end` one past its last.
struct Node {
    start: usize,
    end: usize,
    kind: Kind,
}

enum Kind {
    /// `null`, a boolean, a number or a string, as serde_json reads it alone.
    Scalar(Value),
    Array(Vec<Node>),
    /// Members in the order written, duplicates kept (the shape refuses them): the key,
    /// one past its closing quote, and the value.
    Object(Vec<(String, usize, Node)>),
}

fn is_space(byte: u8) -> bool {
    matches!(byte, b' ' | b'\n' | b'\t' | b'\r')
}

fn skip_space(bytes: &[u8], mut at: usize) -> usize {
    while bytes.get(at).is_some_and(|&b| is_space(b)) {
        at += 1;
    }
    at
}

/// One past the closing quote of the string starting at `at`, if it closes.
fn string_end(bytes: &[u8], at: usize) -> Option<usize> {
    let mut i = at + 1;
    loop {
        match *bytes.get(i)? {
            b'\\' => i += 2,
            b'"' => return Some(i + 1),
            _ => i += 1,
        }
    }
}

/// The scalar token `bytes[start..end]` as serde_json reads it (strings unescaped,
/// numbers as it types them).
fn scalar(bytes: &[u8], start: usize, end: usize) -> Option<Value> {
    serde_json::from_slice(bytes.get(start..end)?).ok()
}

/// Builds the tree of a document serde_json has already accepted.
struct Scanner<'b> {
    bytes: &'b [u8],
    at: usize,
}

impl Scanner<'_> {
    fn value(&mut self) -> Option<Node> {
        let start = skip_space(self.bytes, self.at);
        let kind = match *self.bytes.get(start)? {
            b'{' => {
                let mut members = Vec::new();
                self.at = skip_space(self.bytes, start + 1);
                while *self.bytes.get(self.at)? != b'}' {
                    if self.bytes.get(self.at) == Some(&b',') {
                        self.at = skip_space(self.bytes, self.at + 1);
                    }
                    let key_end = string_end(self.bytes, self.at)?;
                    let Value::String(key) = scalar(self.bytes, self.at, key_end)? else { return None };
                    self.at = skip_space(self.bytes, key_end) + 1; // past the colon
                    let value = self.value()?;
                    members.push((key, key_end, value));
                    self.at = skip_space(self.bytes, self.at);
                }
                self.at += 1;
                Kind::Object(members)
            }
            b'[' => {
                let mut elements = Vec::new();
                self.at = skip_space(self.bytes, start + 1);
                while *self.bytes.get(self.at)? != b']' {
                    if self.bytes.get(self.at) == Some(&b',') {
                        self.at += 1;
                    }
                    elements.push(self.value()?);
                    self.at = skip_space(self.bytes, self.at);
                }
                self.at += 1;
                Kind::Array(elements)
            }
            b'"' => {
                self.at = string_end(self.bytes, start)?;
                Kind::Scalar(scalar(self.bytes, start, self.at)?)
            }
            _ => {
                self.at = token_end(self.bytes, start)?;
                Kind::Scalar(scalar(self.bytes, start, self.at)?)
            }
        };
        Some(Node { start, end: self.at, kind })
    }
}

/// Where a value is in the document, as `serde_path_to_error` writes it.
#[derive(Clone, Copy)]
enum Path<'a> {
    Root,
    Key(&'a Path<'a>, &'a str),
    Index(&'a Path<'a>, usize),
}

impl Path<'_> {
    fn render(&self) -> String {
        let mut segments = Vec::new();
        let mut path = self;
        loop {
            match path {
                Path::Root => break,
                Path::Key(parent, key) => {
                    segments.push((false, (*key).to_string()));
                    path = parent;
                }
                Path::Index(parent, index) => {
                    segments.push((true, format!("[{index}]")));
                    path = parent;
                }
            }
        }
        if segments.is_empty() {
            return ".".to_string();
        }
        let mut out = String::new();
        for (i, (index, segment)) in segments.iter().rev().enumerate() {
            if i > 0 && !index {
                out.push('.');
            }
            out.push_str(segment);
        }
        out
    }
}

/// A deserialization error: the message, the offset serde_json would give it and the
/// innermost path it arose in (each set once, by the first to know). Boxed, as
/// serde_json's is: every generic function of the shape's code passes it on.
#[derive(Debug)]
pub struct Error(Box<Inner>);

#[derive(Debug)]
struct Inner {
    message: String,
    at: Option<usize>,
    path: Option<String>,
}

impl Error {
    #[cold]
    #[inline(never)]
    fn at(mut self, offset: usize) -> Error {
        self.0.at.get_or_insert(offset);
        self
    }

    #[cold]
    #[inline(never)]
    fn on(mut self, path: &Path) -> Error {
        if self.0.path.is_none() {
            self.0.path = Some(path.render());
        }
        self
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0.message)
    }
}

impl std::error::Error for Error {}

impl de::Error for Error {
    fn custom<T: fmt::Display>(message: T) -> Error {
        Error(Box::new(Inner { message: message.to_string(), at: None, path: None }))
    }

    // serde_json's own wording (`null`, its floats).
    fn invalid_type(unexpected: de::Unexpected, expected: &dyn de::Expected) -> Error {
        Error::custom(<serde_json::Error as de::Error>::invalid_type(unexpected, expected))
    }

    fn invalid_value(unexpected: de::Unexpected, expected: &dyn de::Expected) -> Error {
        Error::custom(<serde_json::Error as de::Error>::invalid_value(unexpected, expected))
    }
}

/// Where serde_json's reader stands after an object's closing, from where its members
/// stopped: past the brace if only space is before it.
fn after_object(bytes: &[u8], stopped: usize) -> usize {
    let at = skip_space(bytes, stopped);
    if bytes.get(at) == Some(&b'}') {
        at + 1
    } else {
        at
    }
}

/// The same for an array, whose reader also passes a comma and the space after it.
fn after_array(bytes: &[u8], stopped: usize) -> usize {
    let at = skip_space(bytes, stopped);
    match bytes.get(at) {
        Some(b']') => at + 1,
        Some(b',') => skip_space(bytes, at + 1),
        _ => at,
    }
}

fn unexpected(value: &Value) -> de::Unexpected<'_> {
    match value {
        Value::Null => de::Unexpected::Unit,
        Value::Bool(b) => de::Unexpected::Bool(*b),
        Value::Number(n) => match (n.as_u64(), n.as_i64()) {
            (Some(u), _) => de::Unexpected::Unsigned(u),
            (None, Some(i)) => de::Unexpected::Signed(i),
            _ => de::Unexpected::Float(n.as_f64().unwrap_or(f64::NAN)),
        },
        Value::String(s) => de::Unexpected::Str(s),
        Value::Array(_) => de::Unexpected::Seq,
        Value::Object(_) => de::Unexpected::Map,
    }
}

/// A value of the tree as a serde deserializer.
struct Reader<'a> {
    node: &'a Node,
    path: Path<'a>,
    bytes: &'a [u8],
}

impl<'a> Reader<'a> {
    /// A value of the wrong type, placed where serde_json says so: past a scalar (which it
    /// reads first), at a container's opening.
    fn wrong_type(&self, expected: &dyn de::Expected) -> Error {
        match &self.node.kind {
            Kind::Scalar(value) => <Error as de::Error>::invalid_type(unexpected(value), expected).at(self.node.end),
            Kind::Array(_) => <Error as de::Error>::invalid_type(de::Unexpected::Seq, expected).at(self.node.start),
            Kind::Object(_) => <Error as de::Error>::invalid_type(de::Unexpected::Map, expected).at(self.node.start),
        }
    }

    fn number<'de, V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        let result = match &self.node.kind {
            Kind::Scalar(Value::Number(n)) => match (n.as_u64(), n.as_i64(), n.as_f64()) {
                (Some(u), _, _) => visitor.visit_u64(u),
                (None, Some(i), _) => visitor.visit_i64(i),
                (None, None, Some(f)) => visitor.visit_f64(f),
                _ => Err(self.wrong_type(&visitor)),
            },
            _ => Err(self.wrong_type(&visitor)),
        };
        self.settle(result)
    }

    /// An error leaving a value's deserializer: placed where serde_json would place it
    /// (after a scalar). Its path is the value's, which the member or element it is (or
    /// the document) gives it.
    fn settle<T>(&self, result: Result<T, Error>) -> Result<T, Error> {
        result.map_err(|e| e.at(self.node.end))
    }

    /// The items of this array or object, read from the first.
    fn items<'s, T>(&'s self, items: &'a [T], stopped: &'s Cell<usize>) -> Items<'a, 's, T> {
        Items { items, next: 0, path: &self.path, bytes: self.bytes, stopped }
    }

    fn seq<'de, V: Visitor<'de>>(self, elements: &'a [Node], visitor: V) -> Result<V::Value, Error> {
        let stopped = Cell::new(self.node.start + 1);
        let result = visitor.visit_seq(self.items(elements, &stopped));
        result.map_err(|e| e.at(after_array(self.bytes, stopped.get())))
    }

    fn map<'de, V: Visitor<'de>>(self, members: &'a [(String, usize, Node)], visitor: V) -> Result<V::Value, Error> {
        let stopped = Cell::new(self.node.start + 1);
        let result = visitor.visit_map(self.items(members, &stopped));
        result.map_err(|e| e.at(after_object(self.bytes, stopped.get())))
    }
}

macro_rules! numbers {
    ($($method:ident)*) => {
        $(fn $method<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
            self.number(visitor)
        })*
    };
}

impl<'de, 'a> Deserializer<'de> for Reader<'a> {
    type Error = Error;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        match &self.node.kind {
            Kind::Scalar(Value::Number(_)) => self.number(visitor),
            Kind::Scalar(value) => {
                let result = match value {
                    Value::Null => visitor.visit_unit(),
                    Value::Bool(b) => visitor.visit_bool(*b),
                    Value::String(s) => visitor.visit_str(s),
                    _ => Err(self.wrong_type(&visitor)),
                };
                self.settle(result)
            }
            Kind::Array(elements) => self.seq(elements, visitor),
            Kind::Object(members) => self.map(members, visitor),
        }
    }

    fn deserialize_bool<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        let result = match &self.node.kind {
            Kind::Scalar(Value::Bool(b)) => visitor.visit_bool(*b),
            _ => Err(self.wrong_type(&visitor)),
        };
        self.settle(result)
    }

    numbers!(deserialize_i8 deserialize_i16 deserialize_i32 deserialize_i64 deserialize_i128
             deserialize_u8 deserialize_u16 deserialize_u32 deserialize_u64 deserialize_u128
             deserialize_f32 deserialize_f64);

    fn deserialize_char<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        self.deserialize_str(visitor)
    }

    fn deserialize_str<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        let result = match &self.node.kind {
            Kind::Scalar(Value::String(s)) => visitor.visit_str(s),
            _ => Err(self.wrong_type(&visitor)),
        };
        self.settle(result)
    }

    fn deserialize_string<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        self.deserialize_str(visitor)
    }

    fn deserialize_bytes<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        match &self.node.kind {
            Kind::Scalar(Value::String(s)) => {
                let result = visitor.visit_bytes(s.as_bytes());
                self.settle(result)
            }
            Kind::Array(_) => self.deserialize_seq(visitor),
            _ => Err(self.wrong_type(&visitor)),
        }
    }

    fn deserialize_byte_buf<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        self.deserialize_bytes(visitor)
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        match &self.node.kind {
            Kind::Scalar(Value::Null) => visitor.visit_none(),
            _ => visitor.visit_some(self),
        }
    }

    fn deserialize_unit<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        let result = match &self.node.kind {
            Kind::Scalar(Value::Null) => visitor.visit_unit(),
            _ => Err(self.wrong_type(&visitor)),
        };
        self.settle(result)
    }

    fn deserialize_unit_struct<V: Visitor<'de>>(self, _name: &'static str, visitor: V) -> Result<V::Value, Error> {
        self.deserialize_unit(visitor)
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(self, _name: &'static str, visitor: V) -> Result<V::Value, Error> {
        visitor.visit_newtype_struct(self)
    }

    fn deserialize_seq<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        match &self.node.kind {
            Kind::Array(elements) => self.seq(elements, visitor),
            _ => Err(self.wrong_type(&visitor)),
        }
    }

    fn deserialize_tuple<V: Visitor<'de>>(self, _len: usize, visitor: V) -> Result<V::Value, Error> {
        self.deserialize_seq(visitor)
    }

    fn deserialize_tuple_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _len: usize,
        visitor: V,
    ) -> Result<V::Value, Error> {
        self.deserialize_seq(visitor)
    }

    fn deserialize_map<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        match &self.node.kind {
            Kind::Object(members) => self.map(members, visitor),
            _ => Err(self.wrong_type(&visitor)),
        }
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Error> {
        match &self.node.kind {
            Kind::Object(members) => self.map(members, visitor),
            Kind::Array(elements) => self.seq(elements, visitor),
            Kind::Scalar(_) => Err(self.wrong_type(&visitor)),
        }
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Error> {
        let (path, bytes, node) = (self.path, self.bytes, self.node);
        match &node.kind {
            Kind::Scalar(Value::String(_)) => visitor.visit_enum(Variant { reader: self, member: None }),
            Kind::Object(members) => match members.as_slice() {
                [] => Err(Error::custom("expected value").at(node.end)),
                [(key, key_end, value), rest @ ..] => {
                    let after = value.end;
                    let reader = Reader { node: value, path, bytes };
                    let value = visitor.visit_enum(Variant { reader, member: Some((key, *key_end)) })?;
                    match rest.first() {
                        None => Ok(value),
                        Some(_) => Err(Error::custom("expected value").at(skip_space(bytes, after))),
                    }
                }
            },
            _ => Err(Error::custom("expected value").at(node.start + 1)),
        }
    }

    fn deserialize_identifier<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        self.deserialize_str(visitor)
    }

    fn deserialize_ignored_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        visitor.visit_unit()
    }
}

/// An array's elements (each on its index's path) or an object's members (each value on
/// its key's path), in order.
struct Items<'a, 's, T> {
    items: &'a [T],
    next: usize,
    path: &'s Path<'a>,
    bytes: &'a [u8],
    /// Where serde_json's reader stands: past the last element, key or value read.
    stopped: &'s Cell<usize>,
}

impl<'de> SeqAccess<'de> for Items<'_, '_, Node> {
    type Error = Error;

    fn next_element_seed<T: DeserializeSeed<'de>>(&mut self, seed: T) -> Result<Option<T::Value>, Error> {
        let Some(node) = self.items.get(self.next) else { return Ok(None) };
        let path = Path::Index(self.path, self.next);
        self.next += 1;
        self.stopped.set(node.end);
        seed.deserialize(Reader { node, path, bytes: self.bytes }).map(Some).map_err(|e| e.on(&path))
    }
}

impl<'de> MapAccess<'de> for Items<'_, '_, (String, usize, Node)> {
    type Error = Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(&mut self, seed: K) -> Result<Option<K::Value>, Error> {
        let Some((key, key_end, _)) = self.items.get(self.next) else { return Ok(None) };
        self.stopped.set(*key_end);
        seed.deserialize(Key(key)).map(Some).map_err(|e| e.on(&Path::Key(self.path, key)))
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value, Error> {
        let Some((key, _, node)) = self.items.get(self.next) else {
            return Err(Error::custom("a value asked for before its key"));
        };
        self.next += 1;
        self.stopped.set(node.end);
        let path = Path::Key(self.path, key);
        seed.deserialize(Reader { node, path, bytes: self.bytes }).map_err(|e| e.on(&path))
    }
}

/// A member's key: a string, whatever is asked of it (serde_json's keys are strings).
struct Key<'a>(&'a str);

impl<'de> Deserializer<'de> for Key<'_> {
    type Error = Error;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        visitor.visit_str(self.0)
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        visitor.visit_some(self)
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(self, _name: &'static str, visitor: V) -> Result<V::Value, Error> {
        visitor.visit_newtype_struct(self)
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf unit unit_struct seq
        tuple tuple_struct map struct enum identifier ignored_any
    }
}

/// An enum written as a string (a unit variant) or as an object of one member.
struct Variant<'a> {
    reader: Reader<'a>,
    /// The member's key and where it ends, for the object form.
    member: Option<(&'a str, usize)>,
}

impl<'de, 'a> EnumAccess<'de> for Variant<'a> {
    type Error = Error;
    type Variant = Variant<'a>;

    fn variant_seed<T: DeserializeSeed<'de>>(self, seed: T) -> Result<(T::Value, Variant<'a>), Error> {
        let value = match self.member {
            None => Reader { ..self.reader }.deserialize_str(Seed(seed))?,
            Some((key, end)) => seed.deserialize(Key(key)).map_err(|e| e.at(end))?,
        };
        Ok((value, self))
    }
}

/// A seed as a visitor of the string it is given, for a unit variant's name.
struct Seed<T>(T);

impl<'de, T: DeserializeSeed<'de>> Visitor<'de> for Seed<T> {
    type Value = T::Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a variant name")
    }

    fn visit_str<E: de::Error>(self, name: &str) -> Result<T::Value, E> {
        self.0.deserialize(Key(name)).map_err(|e| E::custom(e.0.message))
    }
}

impl<'de> VariantAccess<'de> for Variant<'_> {
    type Error = Error;

    fn unit_variant(self) -> Result<(), Error> {
        match self.member {
            None => Ok(()),
            Some(_) => de::Deserialize::deserialize(self.reader),
        }
    }

    fn newtype_variant_seed<T: DeserializeSeed<'de>>(self, seed: T) -> Result<T::Value, Error> {
        match self.member {
            None => Err(de::Error::invalid_type(de::Unexpected::UnitVariant, &"newtype variant")),
            Some((key, _)) => {
                let path = Path::Key(&self.reader.path, key);
                seed.deserialize(Reader { path, ..self.reader }).map_err(|e| e.on(&path))
            }
        }
    }

    fn tuple_variant<V: Visitor<'de>>(self, _len: usize, visitor: V) -> Result<V::Value, Error> {
        match self.member {
            None => Err(de::Error::invalid_type(de::Unexpected::UnitVariant, &"tuple variant")),
            Some((key, _)) => {
                let path = Path::Key(&self.reader.path, key);
                Reader { path, ..self.reader }.deserialize_seq(visitor)
            }
        }
    }

    fn struct_variant<V: Visitor<'de>>(self, fields: &'static [&'static str], visitor: V) -> Result<V::Value, Error> {
        match self.member {
            None => Err(de::Error::invalid_type(de::Unexpected::UnitVariant, &"struct variant")),
            Some((key, _)) => {
                let path = Path::Key(&self.reader.path, key);
                Reader { path, ..self.reader }.deserialize_struct("", fields, visitor)
            }
        }
    }
}

/// The byte offset of serde_json's line (from 1) and column (bytes into the line).
fn offset(bytes: &[u8], line: usize, column: usize) -> usize {
    let mut start = 0;
    for _ in 1..line {
        match bytes.get(start..).and_then(|rest| rest.iter().position(|&b| b == b'\n')) {
            Some(newline) => start += newline + 1,
            None => break,
        }
    }
    (start + column).min(bytes.len())
}

fn line_column(bytes: &[u8], at: usize) -> (usize, usize) {
    let before = bytes.get(..at).unwrap_or(bytes);
    let start = before.iter().rposition(|&b| b == b'\n').map_or(0, |newline| newline + 1);
    (1 + before.iter().take(start).filter(|&&b| b == b'\n').count(), before.len() - start)
}

/// Where a syntax error at `at` is, as the path `serde_path_to_error` gave it: the
/// document is read up to the error, and the innermost value being read names it. An
/// object's member whose key is not read yet is `?`; the object's own separators (a
/// colon missing, an array's comma) are the object's or the array's own path.
fn syntax_path(bytes: &[u8], at: usize) -> String {
    let bytes = bytes.get(..at).unwrap_or(bytes);
    let mut stack: Vec<Frame> = Vec::new();
    let mut i = 0;
    loop {
        i = skip_space(bytes, i);
        let Some(&byte) = bytes.get(i) else { break };
        let value_expected = match stack.last_mut() {
            None => i == skip_space(bytes, 0),
            Some(Frame::Object { phase: Phase::Value, .. }) => true,
            Some(Frame::Array { phase, .. }) => match phase {
                Phase::Value => true,
                Phase::Open | Phase::Key if byte == b']' => {
                    if *phase == Phase::Key {
                        break; // a trailing comma
                    }
                    stack.pop();
                    i += 1;
                    finish(&mut stack);
                    continue;
                }
                Phase::Open | Phase::Key => {
                    *phase = Phase::Value;
                    true
                }
                _ => false,
            },
            Some(_) => false,
        };
        if value_expected {
            match byte {
                b'{' => stack.push(Frame::Object { key: None, phase: Phase::Open }),
                b'[' => stack.push(Frame::Array { index: 0, phase: Phase::Open }),
                _ => {
                    let end = if byte == b'"' { string_end(bytes, i) } else { token_end(bytes, i) };
                    match end.filter(|&end| end > i && scalar(bytes, i, end).is_some()) {
                        Some(end) => {
                            i = end;
                            finish(&mut stack);
                            continue;
                        }
                        None => break,
                    }
                }
            }
            i += 1;
            continue;
        }
        match stack.last_mut() {
            Some(Frame::Object { key, phase }) => match (*phase, byte) {
                (Phase::Open | Phase::Key, b'"') => {
                    match string_end(bytes, i).and_then(|end| Some((end, scalar(bytes, i, end)?))) {
                        Some((end, Value::String(name))) => {
                            *key = Some(name);
                            *phase = Phase::Colon;
                            i = end;
                        }
                        _ => break,
                    }
                }
                (Phase::Colon, b':') => {
                    *phase = Phase::Value;
                    i += 1;
                }
                (Phase::Open | Phase::Next, b'}') => {
                    stack.pop();
                    i += 1;
                    finish(&mut stack);
                }
                (Phase::Next, b',') => {
                    *key = None;
                    *phase = Phase::Key;
                    i += 1;
                }
                _ => break,
            },
            Some(Frame::Array { index, phase }) => match (*phase, byte) {
                (Phase::Next, b',') => {
                    *index += 1;
                    *phase = Phase::Key;
                    i += 1;
                }
                (Phase::Next, b']') => {
                    stack.pop();
                    i += 1;
                    finish(&mut stack);
                }
                _ => break,
            },
            None => break, // text after the document
        }
    }
    let mut path = String::new();
    for (depth, frame) in stack.iter().enumerate() {
        let innermost = depth + 1 == stack.len();
        let segment = match frame {
            Frame::Object { key: Some(key), phase: Phase::Value } => key.clone(),
            Frame::Object { phase: Phase::Colon, .. } => continue,
            Frame::Object { .. } if innermost => "?".to_string(),
            Frame::Array { index, phase: Phase::Value } => {
                path.push_str(&format!("[{index}]"));
                continue;
            }
            _ => continue,
        };
        if !path.is_empty() {
            path.push('.');
        }
        path.push_str(&segment);
    }
    if path.is_empty() {
        ".".to_string()
    } else {
        path
    }
}

/// An object or array being read, for `syntax_path`.
enum Frame {
    Object { key: Option<String>, phase: Phase },
    Array { index: usize, phase: Phase },
}

/// Where in a container the reading is: just opened; after a comma (a key or an element
/// expected); after a key (its colon expected); reading a value; after a value.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Phase {
    Open,
    Key,
    Colon,
    Value,
    Next,
}

/// A value was read: the member or element it was is done.
fn finish(stack: &mut [Frame]) {
    if let Some(Frame::Object { phase, .. } | Frame::Array { phase, .. }) = stack.last_mut() {
        *phase = Phase::Next;
    }
}

/// One past the number or literal starting at `at`, as serde_json reads it (a number
/// ends where its grammar does: `1x` is the number 1 and a stray `x`); `None` where it
/// is malformed, an error inside the value.
fn token_end(bytes: &[u8], at: usize) -> Option<usize> {
    let rest = bytes.get(at..)?;
    for literal in [&b"true"[..], b"false", b"null"] {
        if rest.starts_with(literal) {
            return Some(at + literal.len());
        }
    }
    let digits = |mut i: usize| -> Option<usize> {
        let first = i;
        while bytes.get(i).is_some_and(u8::is_ascii_digit) {
            i += 1;
        }
        (i > first).then_some(i)
    };
    let mut i = at + usize::from(rest.first() == Some(&b'-'));
    i = match bytes.get(i)? {
        b'0' if bytes.get(i + 1).is_some_and(u8::is_ascii_digit) => return None,
        b'0' => i + 1,
        b'1'..=b'9' => digits(i)?,
        _ => return None,
    };
    if bytes.get(i) == Some(&b'.') {
        i = digits(i + 1)?;
    }
    if matches!(bytes.get(i), Some(b'e' | b'E')) {
        i += 1;
        if matches!(bytes.get(i), Some(b'+' | b'-')) {
            i += 1;
        }
        i = digits(i)?;
    }
    Some(i)
}

// The differential tests against `serde_path_to_error` (a native dev-dependency).
#[cfg(all(test, not(target_arch = "wasm32")))]
#[path = "read_tests.rs"]
mod tests;
