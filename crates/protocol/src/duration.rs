//! Durations as operators write them in config (`"250ms"`, `"1m"`, `"1.5s"`, `"1d"`) and as
//! OpenAI's `x-ratelimit-reset-*` headers show them (`"17ms"`, `"6m0s"`, Go's style).

use std::time::Duration;

/// Parses `<number><unit>` with unit `ms`, `s`, `m`, `h` or `d`; the number may have a
/// fractional part. The error says what is wrong and never echoes more than the input.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .ok_or_else(|| format!("invalid duration {text:?}: missing unit (use ms, s, m, h or d)"))?;
    let (number, unit) = text.split_at(split);
    let value: f64 = number.parse().map_err(|_| format!("invalid duration {text:?}: {number:?} is not a number"))?;
    let unit_ms = match unit {
        "ms" => 1.0,
        "s" => 1_000.0,
        "m" => 60_000.0,
        "h" => 3_600_000.0,
        "d" => 86_400_000.0,
        other => return Err(format!("invalid duration {text:?}: unknown unit {other:?} (use ms, s, m, h or d)")),
    };
    let millis = value * unit_ms;
    if !millis.is_finite() || millis > 10.0 * 365.0 * 86_400_000.0 {
        return Err(format!("invalid duration {text:?}: too large"));
    }
    Ok(Duration::from_micros((millis * 1000.0).round() as u64))
}

/// Formats milliseconds the way OpenAI's reset headers do (Go's `time.Duration` string):
/// `0s`, `17ms`, `1s`, `1.5s`, `6m0s`, `1h2m3s`.
pub fn format_reset(ms: u64) -> String {
    let mut text = String::with_capacity(8);
    reset_pieces(ms, &mut |piece| text.push_str(piece));
    text
}

/// [`format_reset`]'s text handed to `piece` a piece at a time, in order, without `format!`
/// or a `String` of its own: a header written on every admitted response is filled in place.
pub fn reset_pieces(ms: u64, piece: &mut impl FnMut(&str)) {
    if ms == 0 {
        return piece("0s");
    }
    let mut digits = itoa::Buffer::new();
    if ms < 1_000 {
        // The common case: a bucket that refills continuously resets within a second.
        piece(digits.format(ms));
        return piece("ms");
    }
    let (hours, minutes, seconds_ms) = (ms / 3_600_000, (ms % 3_600_000) / 60_000, ms % 60_000);
    if hours > 0 {
        piece(digits.format(hours));
        piece("h");
    }
    if hours > 0 || minutes > 0 {
        piece(digits.format(minutes));
        piece("m");
    }
    piece(digits.format(seconds_ms / 1_000));
    let fraction = seconds_ms % 1_000;
    if fraction != 0 {
        // Three digits less their trailing zeros (at least one digit is not a zero).
        let milli = [fraction / 100, fraction / 10 % 10, fraction % 10].map(|d| b'0' + d as u8);
        let kept = milli.iter().rposition(|&d| d != b'0').map_or(0, |last| last + 1);
        piece(".");
        piece(std::str::from_utf8(milli.get(..kept).unwrap_or_default()).unwrap_or_default());
    }
    piece("s");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_unit() {
        let cases = [
            ("250ms", 250_000),
            ("1s", 1_000_000),
            ("1.5s", 1_500_000),
            ("1m", 60_000_000),
            ("2h", 7_200_000_000),
            ("1d", 86_400_000_000),
            ("0.5ms", 500),
        ];
        for (text, micros) in cases {
            assert_eq!(parse_duration(text), Ok(Duration::from_micros(micros)), "{text}");
        }
    }

    #[test]
    fn rejects_bad_durations_with_a_reason() {
        let cases = [
            ("10", "missing unit"),
            ("", "missing unit"),
            ("5x", "unknown unit \"x\""),
            ("1.2.3s", "is not a number"),
            ("s", "is not a number"),
            ("99999999d", "too large"),
            ("-1s", "is not a number"),
        ];
        for (text, reason) in cases {
            let err = parse_duration(text).expect_err(text);
            assert!(err.contains(reason), "{text}: {err}");
        }
    }

    #[test]
    fn formats_like_openai_reset_headers() {
        let cases = [
            (0, "0s"),
            (17, "17ms"),
            (1_000, "1s"),
            (1_500, "1.5s"),
            (1_250, "1.25s"),
            (59_999, "59.999s"),
            (360_000, "6m0s"),
            (90_500, "1m30.5s"),
            (3_723_000, "1h2m3s"),
            (1_010, "1.01s"),
            (3_600_000, "1h0m0s"),
            (3_600_100, "1h0m0.1s"),
        ];
        for (ms, text) in cases {
            assert_eq!(format_reset(ms), text, "{ms}");
        }
    }
}
