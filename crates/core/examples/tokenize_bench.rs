//! Native tokenizer throughput, the baseline for the in-filter figure `make bench` prints.
//! Usage: cargo run --release --example tokenize_bench -- FILE
//! Prints one JSON line: bytes, tokens (o200k_base) and MB/s.

use llm_ratelimit_core::tokens::Encoding;
use std::time::{Duration, Instant};

fn main() {
    let Some(path) = std::env::args().nth(1) else {
        eprintln!("usage: tokenize_bench FILE");
        std::process::exit(2);
    };
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(err) => {
            eprintln!("cannot read {path}: {err}");
            std::process::exit(1);
        }
    };
    let encoding = Encoding::O200kBase;
    let tokens = encoding.count(&text); // also builds the vocabulary, outside the timing
    let started = Instant::now();
    let mut rounds = 0u32;
    while started.elapsed() < Duration::from_secs(2) || rounds < 3 {
        std::hint::black_box(encoding.count(std::hint::black_box(&text)));
        rounds += 1;
    }
    let seconds = started.elapsed().as_secs_f64();
    let mb_per_s = text.len() as f64 * f64::from(rounds) / seconds / 1e6;
    println!("{{\"bytes\": {}, \"tokens\": {tokens}, \"mb_per_s\": {mb_per_s:.2}}}", text.len());
}
