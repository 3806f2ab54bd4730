//! `llm-ratelimit reset`: delete a tenant's counters for a policy's limits, so it starts
//! as a tenant never seen. The companion logs the reset (tenant id, limit names) and
//! counts it.

use crate::tenant::TenantArgs;
use llm_ratelimit_protocol::{ResetReply, RESET_PATH};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    tenant: TenantArgs,
}

pub fn run(args: &Args) -> Result<(), String> {
    let resolved = args.tenant.resolve()?;
    let reply: ResetReply = args.tenant.call(&resolved, RESET_PATH)?;
    let names: Vec<&str> = resolved.request.limits.iter().map(|l| l.name.as_str()).collect();
    println!(
        "reset tenant {} in domain {}: {} ({} counters deleted; a limit at full has none)",
        resolved.request.tenant,
        resolved.request.domain,
        names.join(", "),
        reply.deleted
    );
    Ok(())
}
