//! Calendar periods: the day, week or month of a time zone that a calendar budget is
//! spent in, and its boundaries as instants. A budget is full again at local midnight
//! of the next day, the next Monday (weeks start on Monday, as ISO 8601 has it) or the
//! 1st of the next month: a day in a zone with daylight saving time is 23 or 25 hours
//! twice a year, a month 28 to 31 days, and a zone whose clocks skip midnight starts its
//! day at the first instant that exists.
//!
//! The zone rules are the IANA database bundled into the module (jiff's copy, compiled
//! in: the filter has no file system); zones are looked up once, at load. What runs per
//! request is `bounds_ms`: the boundaries around the proxy's clock, which Redis picks
//! the period from with its own (`lua/limits.lua`'s calendar driver).

use jiff::civil::Date;
use jiff::tz::{TimeZone, TimeZoneDatabase};
use jiff::{Span, Timestamp};
use serde::{Deserialize, Serialize};

/// How many boundaries a charge carries: the starts of the period before the proxy's,
/// of its own, of the next and of the one after, so Redis's clock may be a whole period
/// either side of the proxy's.
pub const BOUNDS: usize = 4;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Period {
    Day,
    Week,
    Month,
}

impl Period {
    pub fn name(self) -> &'static str {
        match self {
            Period::Day => "day",
            Period::Week => "week",
            Period::Month => "month",
        }
    }

    /// The longest a period runs, in ms (a day of 25 hours, a month of 31 days): what
    /// stands for the window where a length is needed without a date.
    pub fn longest_ms(self) -> u64 {
        const HOUR_MS: u64 = 3_600_000;
        match self {
            Period::Day => 25 * HOUR_MS,
            Period::Week => (7 * 24 + 1) * HOUR_MS,
            Period::Month => (31 * 24 + 1) * HOUR_MS,
        }
    }

    /// The first day of the period `date` is in.
    fn first_day(self, date: Date) -> Option<Date> {
        match self {
            Period::Day => Some(date),
            Period::Week => date.checked_sub(days(i64::from(date.weekday().to_monday_zero_offset()))?).ok(),
            Period::Month => Some(date.first_of_month()),
        }
    }

    /// The first day of the period `periods` after (or before) the one starting `first`.
    fn shifted(self, first: Date, periods: i64) -> Option<Date> {
        match self {
            Period::Day => first.checked_add(days(periods)?).ok(),
            Period::Week => first.checked_add(days(7 * periods)?).ok(),
            Period::Month => first.checked_add(Span::new().try_months(periods).ok()?).ok(),
        }
    }
}

/// A span of `n` days, `None` out of jiff's range. The fallible form: jiff's `days()`
/// panics there, and its panic message brings jiff's whole error formatting (some 35 KB of
/// code) into the module, which V8 compiles at start-up.
fn days(n: i64) -> Option<Span> {
    Span::new().try_days(n).ok()
}

/// A calendar period in a time zone: the window of a calendar budget.
#[derive(Debug, Clone)]
pub struct Calendar {
    pub period: Period,
    /// The zone's IANA name as written (`UTC` when none was).
    pub zone_name: String,
    zone: TimeZone,
}

impl PartialEq for Calendar {
    fn eq(&self, other: &Calendar) -> bool {
        self.period == other.period && self.zone_name == other.zone_name
    }
}

impl Calendar {
    /// `period` in the IANA zone `zone_name` (`None`: UTC); `Err` if the bundled
    /// database has no such zone.
    pub fn new(period: Period, zone_name: Option<&str>) -> Result<Calendar, String> {
        let (zone_name, zone) = match zone_name {
            None => ("UTC".to_string(), TimeZone::UTC),
            Some(name) => match TimeZoneDatabase::bundled().get(name) {
                Ok(zone) => (name.to_string(), zone),
                Err(_) => {
                    return Err(format!("{name:?} is not a time zone of the IANA database (e.g. \"Europe/Amsterdam\")"))
                }
            },
        };
        Ok(Calendar { period, zone_name, zone })
    }

    /// The instant (ms since the epoch) a local day starts: its midnight, or, where the
    /// clocks skip midnight, the first instant after the gap.
    fn day_start_ms(&self, date: Date) -> Option<u64> {
        let start = date.to_zoned_datetime(self.zone.clone()).ok()?.start_of_day().ok()?;
        u64::try_from(start.timestamp().as_millisecond()).ok()
    }

    /// The period boundaries around `now_ms` ([`BOUNDS`] of them, ascending): the starts
    /// of the period before the one `now_ms` is in, of that one, of the next and of the
    /// one after. Empty only for an instant out of the calendar's range (not of this era).
    pub fn bounds_ms(&self, now_ms: u64) -> Vec<u64> {
        let bounds = || -> Option<Vec<u64>> {
            let now = Timestamp::from_millisecond(i64::try_from(now_ms).ok()?).ok()?;
            let today = now.to_zoned_datetime(self.zone.clone()).date();
            let first = self.period.first_day(today)?;
            (-1..=2).map(|n| self.day_start_ms(self.period.shifted(first, n)?)).collect()
        };
        bounds().unwrap_or_default()
    }

    /// The period `now_ms` is in, as its start and end (ms), from `bounds` as
    /// [`Calendar::bounds_ms`] gives them: the one Redis picks with its own clock.
    pub fn period_at(bounds: &[u64], now_ms: f64) -> Option<(u64, u64)> {
        bounds.windows(2).find_map(|pair| match *pair {
            [start, end] if start as f64 <= now_ms && now_ms < end as f64 => Some((start, end)),
            _ => None,
        })
    }

    /// How the period is said in messages: `calendar month (Europe/Amsterdam)`.
    pub fn describe(&self) -> String {
        format!("calendar {} ({})", self.period.name(), self.zone_name)
    }

    /// The local date and time of an instant in the calendar's zone, to the minute with
    /// the offset (`2026-04-01 00:00 +02:00`), for operators.
    pub fn local_time(&self, at_ms: u64) -> String {
        self.format(at_ms, "%Y-%m-%d %H:%M %:z")
    }

    /// The instant as RFC 3339 in the calendar's zone (`2026-04-01T00:00:00+02:00`).
    pub fn rfc3339(&self, at_ms: u64) -> String {
        self.format(at_ms, "%Y-%m-%dT%H:%M:%S%:z")
    }

    fn format(&self, at_ms: u64, pattern: &str) -> String {
        let at = i64::try_from(at_ms).ok().and_then(|ms| Timestamp::from_millisecond(ms).ok());
        match at {
            Some(at) => at.to_zoned_datetime(self.zone.clone()).strftime(pattern).to_string(),
            None => String::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOUR: u64 = 3_600_000;

    /// Milliseconds of an RFC 3339 instant: the expected boundaries are written as the
    /// zone's published local times with their offsets, not computed by the code.
    fn ms(rfc3339: &str) -> u64 {
        let at: Timestamp = rfc3339.parse().unwrap_or_else(|e| panic!("{rfc3339}: {e}"));
        at.as_millisecond() as u64
    }

    fn calendar(period: Period, zone: &str) -> Calendar {
        Calendar::new(period, Some(zone)).unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn days_in_amsterdam_are_23_and_25_hours_at_the_dst_changes() {
        let days = calendar(Period::Day, "Europe/Amsterdam");
        // 2026-03-29: clocks go from 02:00 CET (+01:00) to 03:00 CEST (+02:00).
        let spring = days.bounds_ms(ms("2026-03-29T12:00:00+02:00"));
        assert_eq!(
            spring,
            [
                ms("2026-03-28T00:00:00+01:00"),
                ms("2026-03-29T00:00:00+01:00"),
                ms("2026-03-30T00:00:00+02:00"),
                ms("2026-03-31T00:00:00+02:00"),
            ]
        );
        assert_eq!(spring[2] - spring[1], 23 * HOUR);
        // 2026-10-25: back from 03:00 CEST to 02:00 CET.
        let autumn = days.bounds_ms(ms("2026-10-25T01:00:00Z"));
        assert_eq!(autumn[1], ms("2026-10-25T00:00:00+02:00"));
        assert_eq!(autumn[2] - autumn[1], 25 * HOUR);
        assert_eq!(autumn[3] - autumn[2], 24 * HOUR);
    }

    #[test]
    fn a_month_starts_at_local_midnight_on_the_1st() {
        let months = calendar(Period::Month, "Europe/Amsterdam");
        // One millisecond before April in Amsterdam is still March; April starts at
        // 2026-03-31T22:00Z (CEST), March started at 2026-02-28T23:00Z (CET).
        let april = ms("2026-04-01T00:00:00+02:00");
        assert_eq!(months.bounds_ms(april - 1)[1..3], [ms("2026-03-01T00:00:00+01:00"), april]);
        assert_eq!(months.bounds_ms(april)[1], april);
        // March is 31 days less the hour DST took.
        assert_eq!(april - ms("2026-03-01T00:00:00+01:00"), (31 * 24 - 1) * HOUR);
    }

    #[test]
    fn months_run_28_to_31_days_and_february_has_29_in_a_leap_year() {
        let months = calendar(Period::Month, "UTC");
        let lengths = |year: i16| -> Vec<u64> {
            (1..=12)
                .map(|month| {
                    let now = ms(&format!("{year}-{month:02}-15T12:00:00Z"));
                    let bounds = months.bounds_ms(now);
                    (bounds[2] - bounds[1]) / (24 * HOUR)
                })
                .collect()
        };
        assert_eq!(lengths(2026), [31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31]);
        assert_eq!(lengths(2028)[1], 29, "2028 is a leap year");
        assert_eq!(lengths(2100)[1], 28, "2100 is not (divisible by 100, not by 400)");
        assert_eq!(lengths(2000)[1], 29, "2000 is (divisible by 400)");
        // The year turns over: December's next period is January.
        assert_eq!(months.bounds_ms(ms("2026-12-31T23:59:59.999Z"))[2], ms("2027-01-01T00:00:00Z"));
        assert_eq!(Calendar::new(Period::Month, None).map(|c| c.zone_name), Ok("UTC".to_string()));
    }

    #[test]
    fn weeks_start_on_monday() {
        let weeks = calendar(Period::Week, "America/New_York");
        // 2026-03-08 (a Sunday) is the US change to EDT; 2026-03-02 is the Monday before.
        let bounds = weeks.bounds_ms(ms("2026-03-08T12:00:00-04:00"));
        assert_eq!(bounds[1], ms("2026-03-02T00:00:00-05:00"));
        assert_eq!(bounds[2], ms("2026-03-09T00:00:00-04:00"));
        assert_eq!(bounds[2] - bounds[1], (7 * 24 - 1) * HOUR);
        // A Monday is the first day of its own week.
        assert_eq!(weeks.bounds_ms(ms("2026-03-09T00:00:00-04:00"))[1], ms("2026-03-09T00:00:00-04:00"));
    }

    #[test]
    fn a_day_whose_midnight_does_not_exist_starts_after_the_gap() {
        // America/Havana skips from 00:00 to 01:00 at its spring change (2026-03-08).
        let days = calendar(Period::Day, "America/Havana");
        let bounds = days.bounds_ms(ms("2026-03-08T12:00:00-04:00"));
        assert_eq!(bounds[1], ms("2026-03-08T01:00:00-04:00"));
        assert_eq!(bounds[1] - bounds[0], 24 * HOUR);
        assert_eq!(bounds[2] - bounds[1], 23 * HOUR);
    }

    #[test]
    fn redis_picks_the_period_of_its_own_clock() {
        let bounds = [10, 20, 30, 40];
        assert_eq!(Calendar::period_at(&bounds, 19.9), Some((10, 20)));
        assert_eq!(Calendar::period_at(&bounds, 20.0), Some((20, 30)), "a boundary starts its period");
        assert_eq!(Calendar::period_at(&bounds, 39.0), Some((30, 40)));
        assert_eq!(Calendar::period_at(&bounds, 40.0), None, "beyond the boundaries sent");
        assert_eq!(Calendar::period_at(&bounds, 5.0), None);
    }

    #[test]
    fn an_unknown_zone_is_refused_and_the_period_is_said_in_full() {
        assert!(Calendar::new(Period::Day, Some("Europe/Atlantis")).is_err_and(|e| e.contains("Europe/Atlantis")));
        let months = calendar(Period::Month, "Europe/Amsterdam");
        assert_eq!(months.describe(), "calendar month (Europe/Amsterdam)");
        assert_eq!(months.local_time(ms("2026-03-31T22:00:00Z")), "2026-04-01 00:00 +02:00");
    }
}
