//! Reading fields of untrusted JSON without indexing.

use serde_json::Value;

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_fields_and_non_objects_read_as_null() {
        let value: Value = serde_json::json!({"a": {"b": 1}, "list": [1]});
        assert_eq!(value.at("a").at("b"), &Value::from(1));
        assert!(value.at("missing").at("deeper").is_null());
        assert!(value.at("list").at("b").is_null());
        assert!(Value::from(3).at("x").is_null());
    }
}
