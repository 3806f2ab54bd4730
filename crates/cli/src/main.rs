//! `llm-ratelimit`: the operator's command. Each subcommand lives in its own module; this
//! file only parses the command line and dispatches.

mod reset;
mod tenant;
mod usage;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "llm-ratelimit", version, about = "Operate llm-ratelimit: where a tenant stands, reset a tenant")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Where a tenant stands on each limit of a policy, charging nothing.
    Usage(usage::Args),
    /// Delete a tenant's counters for a policy's limits (the tenant starts afresh).
    Reset(reset::Args),
}

fn main() -> ExitCode {
    let result = match Cli::parse().command {
        Command::Usage(args) => usage::run(&args),
        Command::Reset(args) => reset::run(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("llm-ratelimit: {message}");
            ExitCode::FAILURE
        }
    }
}
