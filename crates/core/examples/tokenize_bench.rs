//! Native tokenizer throughput on one text: tiktoken-rs's `count_ordinary`, the baseline
//! for the in-filter figure `make bench` prints, and ours (`Encoding::count`), which the
//! filter runs.
//! Usage: cargo run --release --example tokenize_bench -- FILE [o200k_base|cl100k_base]
//! Prints one JSON line: bytes, tokens, tiktoken-rs's MB/s (`mb_per_s`) and ours
//! (`ours_mb_per_s`).

use llm_ratelimit_core::tokens::Encoding;
use std::time::{Duration, Instant};

/// MB/s of `count` on `text`, over at least 2 seconds and 3 rounds.
fn rate(text: &str, count: impl Fn(&str) -> u64) -> f64 {
    count(text); // builds what is built on first use, outside the timing
    let started = Instant::now();
    let mut rounds = 0u32;
    while started.elapsed() < Duration::from_secs(2) || rounds < 3 {
        std::hint::black_box(count(std::hint::black_box(text)));
        rounds += 1;
    }
    text.len() as f64 * f64::from(rounds) / started.elapsed().as_secs_f64() / 1e6
}

fn main() {
    let mut args = std::env::args().skip(1);
    let Some(path) = args.next() else {
        eprintln!("usage: tokenize_bench FILE [o200k_base|cl100k_base]");
        std::process::exit(2);
    };
    let (encoding, tiktoken) = match args.next().as_deref() {
        None | Some("o200k_base") => (Encoding::O200kBase, tiktoken_rs::o200k_base_singleton()),
        Some("cl100k_base") => (Encoding::Cl100kBase, tiktoken_rs::cl100k_base_singleton()),
        Some(other) => {
            eprintln!("unknown encoding {other}");
            std::process::exit(2);
        }
    };
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(err) => {
            eprintln!("cannot read {path}: {err}");
            std::process::exit(1);
        }
    };
    let tokens = encoding.count(&text);
    let expected = tiktoken.count_ordinary(&text) as u64;
    if tokens != expected {
        eprintln!("counts differ: ours {tokens}, tiktoken-rs {expected}");
        std::process::exit(1);
    }
    let baseline = rate(&text, |text| tiktoken.count_ordinary(text) as u64);
    let ours = rate(&text, |text| encoding.count(text));
    println!(
        "{{\"bytes\": {}, \"tokens\": {tokens}, \"mb_per_s\": {baseline:.2}, \"ours_mb_per_s\": {ours:.2}}}",
        text.len()
    );
}
