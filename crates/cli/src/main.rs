//! `llm-ratelimit`: the operator's command. Each subcommand lives in its own module; this
//! file only parses the command line and dispatches.
// Input is the user's files and the companion's replies: an error message, never a panic.
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing))]

mod check_config;
mod lint;
mod package_wasm;
mod plan;
mod reset;
mod spend;
mod tenant;
mod usage;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "llm-ratelimit",
    version,
    about = "Operate llm-ratelimit: check configs, package the filter, see and reset where a tenant stands"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    CheckConfig(check_config::Args),
    PackageWasm(package_wasm::Args),
    /// Where a tenant stands on each limit of a policy, charging nothing.
    Usage(usage::Args),
    /// Delete a tenant's counters for a policy's limits (the tenant starts afresh).
    Reset(reset::Args),
    /// The spend ledger over a date range: requests, tokens and cost by tenant, team, model, day.
    Spend(spend::Args),
    /// Owners' plans at runtime: set, show, delete, list, import, export, history.
    Plan(plan::Args),
}

fn main() -> ExitCode {
    let result = match Cli::parse().command {
        Command::CheckConfig(args) => return check_config::run(&args),
        Command::PackageWasm(args) => return package_wasm::run(&args),
        Command::Usage(args) => usage::run(&args),
        Command::Reset(args) => reset::run(&args),
        Command::Spend(args) => spend::run(&args),
        Command::Plan(args) => plan::run(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("llm-ratelimit: {message}");
            ExitCode::FAILURE
        }
    }
}
