//! `llm-ratelimit`: the operator's command. Each subcommand lives in its own module; this
//! file only dispatches.
// Input is the user's files: an error message, never a panic.
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing))]

mod check_config;
mod package_wasm;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "llm-ratelimit", version, about = "Operate llm-ratelimit: check configs, package the filter")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    CheckConfig(check_config::Args),
    PackageWasm(package_wasm::Args),
}

fn main() -> ExitCode {
    match Cli::parse().command {
        Command::CheckConfig(args) => check_config::run(&args),
        Command::PackageWasm(args) => package_wasm::run(&args),
    }
}
