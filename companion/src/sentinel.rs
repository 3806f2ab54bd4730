//! Redis behind Sentinel: the Sentinels name the primary of a master name, and the
//! companion talks to that primary over one multiplexed connection. When the primary fails
//! the companion asks again and moves to the replica Sentinel promoted.
//!
//! Finding the primary is the `redis` crate's (`sentinel` feature): it asks the Sentinels
//! (`SENTINEL MASTERS`), skips a primary they mark down, and checks with `ROLE` that the
//! server named really is a primary before handing it over, with TLS and credentials of
//! their own for the Sentinels and for the data nodes. What it does not do is follow a
//! failover on a connection already made (its client is a one-shot look-up, and
//! `ConnectionManager` reconnects to the address it started with): that is here. A call
//! that fails in a way a failover explains (the connection dropped or refused, no answer
//! in time, `READONLY` from a primary demoted to replica, `MASTERDOWN`) starts one look-up
//! in the background; until it finds a primary the calls fail fast on the old connection
//! (the filter decides locally meanwhile), and from the swap on they go to the new one.
//! A failover no call notices (`SENTINEL FAILOVER`: the old primary stays up, taking
//! writes, until Sentinel demotes it some 10 s later) is heard on the Sentinels'
//! `+switch-master` channel, which starts a look-up too.
//! The scripts are not copied by the promotion as such: a call that meets NOSCRIPT on the
//! new primary loads its script there (`Store::run`).

use crate::store::{Access, Sentinels};
use futures_util::StreamExt;
use redis::aio::MultiplexedConnection;
use redis::io::tcp::TcpSettings;
use redis::sentinel::{SentinelClient, SentinelClientBuilder, SentinelServerType};
use redis::{AsyncConnectionConfig, ConnectionAddr, ErrorKind, IntoConnectionInfo, RedisError, ServerErrorKind};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Longest wait for one look-up (all the Sentinels, then the primary's `ROLE`, then the
/// connection to it); the crate bounds each connection it makes by 1 s.
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(3);
/// Pause between look-ups while none finds a primary (the Sentinels have yet to agree on
/// one): the time from a promotion to the first call served is at most this plus a look-up.
const LOOKUP_PAUSE: Duration = Duration::from_millis(100);
/// How long a look-up started by an announced switch asks again while the Sentinel asked
/// still names the old primary.
const ANNOUNCED_WAIT: Duration = Duration::from_secs(5);
/// The Sentinels' channel announcing a failover done.
const SWITCH_CHANNEL: &str = "+switch-master";
/// A call that only timed out (the primary may just be busy) starts a look-up at most this
/// often.
const TIMEOUT_LOOKUP_INTERVAL: Duration = Duration::from_secs(1);

/// The connection to the primary in use, and which one it is.
#[derive(Clone)]
struct Current {
    connection: MultiplexedConnection,
    address: String,
    /// Counts the swaps: an error from a call on an older connection starts no look-up.
    generation: u64,
}

pub struct Primary {
    master: String,
    /// A client of each Sentinel (its address, credentials and TLS), to explain a failed
    /// look-up and to hear of switches.
    sentinels: Vec<redis::Client>,
    client: tokio::sync::Mutex<SentinelClient>,
    config: AsyncConnectionConfig,
    current: Mutex<Current>,
    looking: AtomicBool,
    /// When the last look-up ended.
    looked: Mutex<Option<Instant>>,
}

impl Primary {
    /// Asks the Sentinels for the primary of `target.master` and connects to it.
    pub async fn connect(target: &Sentinels, access: &Access, timeout: Duration) -> Result<Arc<Primary>, RedisError> {
        let tcp = TcpSettings::default().set_nodelay(true);
        let scheme = if target.tls { "rediss" } else { "redis" };
        let mut addresses: Vec<ConnectionAddr> = Vec::new();
        for (host, port) in &target.addresses {
            addresses.push(format!("{scheme}://{host}:{port}").into_connection_info()?.addr().clone());
        }
        let mut builder = SentinelClientBuilder::new(addresses.clone(), &target.master, SentinelServerType::Master)?
            .set_client_to_redis_db(target.db)
            .set_client_to_redis_tcp_settings(tcp.clone())
            .set_client_to_sentinel_tcp_settings(tcp.clone());
        if target.tls {
            builder = builder.set_client_to_redis_tls_mode(redis::TlsMode::Secure);
        }
        if let Some(username) = access.username.as_ref().or(target.username.as_ref()) {
            builder = builder.set_client_to_redis_username(username);
        }
        if let Some(password) = access.password.as_ref().or(target.password.as_ref()) {
            builder = builder.set_client_to_redis_password(password);
        }
        if let Some(username) = &access.sentinel_username {
            builder = builder.set_client_to_sentinel_username(username);
        }
        if let Some(password) = &access.sentinel_password {
            builder = builder.set_client_to_sentinel_password(password);
        }
        if let Some(certificates) = &access.certificates {
            builder = builder
                .set_client_to_redis_certificates(certificates.clone())
                .set_client_to_sentinel_certificates(certificates.clone());
        }
        let mut sentinel_settings = redis::RedisConnectionInfo::default();
        if let Some(username) = &access.sentinel_username {
            sentinel_settings = sentinel_settings.set_username(username);
        }
        if let Some(password) = &access.sentinel_password {
            sentinel_settings = sentinel_settings.set_password(password);
        }
        let mut sentinels = Vec::new();
        for (host, port) in &target.addresses {
            let info = format!("{scheme}://{host}:{port}").into_connection_info()?;
            let info = info.set_redis_settings(sentinel_settings.clone()).set_tcp_settings(tcp.clone());
            sentinels.push(match &access.certificates {
                Some(certificates) => redis::Client::build_with_tls(info, certificates.clone())?,
                None => redis::Client::open(info)?,
            });
        }
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(timeout.max(Duration::from_secs(1))))
            .set_response_timeout(Some(timeout));
        let mut client = builder.build()?;
        let (connection, address) = match lookup(&mut client, &config).await {
            Ok(found) => found,
            Err(err) => return Err(explain(&target.master, &sentinels, err).await),
        };
        eprintln!(
            "companion: Sentinel: primary of {:?} at {address} (from {} Sentinel(s))",
            target.master,
            target.addresses.len()
        );
        let primary = Arc::new(Primary {
            master: target.master.clone(),
            sentinels,
            client: tokio::sync::Mutex::new(client),
            config,
            current: Mutex::new(Current { connection, address, generation: 0 }),
            looking: AtomicBool::new(false),
            looked: Mutex::new(None),
        });
        tokio::spawn(watch(Arc::downgrade(&primary)));
        Ok(primary)
    }

    /// The connection to the primary, and its generation (for `failed`).
    fn connection(&self) -> (MultiplexedConnection, u64) {
        let current = self.current.lock().unwrap_or_else(|e| e.into_inner());
        (current.connection.clone(), current.generation)
    }

    /// Runs `cmd` on the primary; an error a failover explains starts a look-up.
    pub async fn query(self: &Arc<Self>, cmd: &redis::Cmd, timeout: Duration) -> Result<redis::Value, RedisError> {
        let (mut connection, generation) = self.connection();
        let result = crate::store::bounded(timeout, cmd.query_async(&mut connection)).await;
        if let Err(err) = &result {
            self.failed(generation, err);
        }
        result
    }

    /// A call on the connection of `generation` failed with `err`: if a failover may
    /// explain it, look the primary up again.
    fn failed(self: &Arc<Self>, generation: u64, err: &RedisError) {
        let only_slow = err.is_timeout();
        if !(only_slow || moved_on(err)) || self.connection().1 != generation {
            return; // not a failover's doing, or an older connection's (already replaced)
        }
        if only_slow {
            let looked = *self.looked.lock().unwrap_or_else(|e| e.into_inner());
            if looked.is_some_and(|at| at.elapsed() < TIMEOUT_LOOKUP_INTERVAL) {
                return;
            }
        }
        // A primary that only answered late stays; one that dropped the connection or
        // refused a write is connected to afresh, even at the same address (a restart).
        let want = if only_slow { Want::Moved(None) } else { Want::Fresh };
        self.look_up(want, err.to_string());
    }

    /// Starts a look-up in the background, unless one is under way.
    fn look_up(self: &Arc<Self>, want: Want, reason: String) {
        if self.looking.swap(true, Ordering::AcqRel) {
            return;
        }
        let primary = self.clone();
        tokio::spawn(async move {
            primary.follow(want, &reason).await;
            *primary.looked.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
            primary.looking.store(false, Ordering::Release);
        });
    }

    /// Looks the primary up until a look-up finds one (the one announced, if one was),
    /// and swaps the connection for one to it.
    async fn follow(&self, want: Want, reason: &str) {
        let started = Instant::now();
        let mut failures = 0u32;
        loop {
            let found = {
                let mut client = self.client.lock().await;
                lookup(&mut client, &self.config).await
            };
            let (connection, address) = match found {
                Ok(found) => found,
                Err(err) => {
                    failures += 1;
                    // The first, then one in twenty (two seconds of look-ups): a failover
                    // takes Sentinel seconds, and each look-up fails until it is done.
                    if failures % 20 == 1 {
                        let err = explain(&self.master, &self.sentinels, err).await;
                        eprintln!(
                            "companion: Sentinel: no primary of {:?} yet ({failures} look-ups): {err}",
                            self.master
                        );
                    }
                    tokio::time::sleep(LOOKUP_PAUSE).await;
                    continue;
                }
            };
            // `None`: ask again; else whether the connection was swapped, and from where.
            let swapped = {
                let mut current = self.current.lock().unwrap_or_else(|e| e.into_inner());
                match &want {
                    // A Sentinel announced a switch the one asked has yet to learn of (they
                    // agree within a second or two): ask again, for a while.
                    Want::Moved(Some(announced))
                        if address == current.address
                            && *announced != address
                            && started.elapsed() < ANNOUNCED_WAIT =>
                    {
                        None
                    }
                    Want::Moved(_) if address == current.address => Some(None),
                    _ => {
                        let was = std::mem::replace(&mut current.address, address.clone());
                        current.connection = connection;
                        current.generation += 1;
                        Some(Some(was))
                    }
                }
            };
            match swapped {
                None => tokio::time::sleep(LOOKUP_PAUSE).await,
                Some(None) => return,
                Some(Some(was)) => {
                    eprintln!(
                        "companion: Sentinel: primary of {:?} now at {address} (was {was}; {} ms after \"{reason}\", \
                         {failures} look-up(s) found none)",
                        self.master,
                        started.elapsed().as_millis()
                    );
                    return;
                }
            }
        }
    }
}

/// What a look-up is for.
enum Want {
    /// A new connection, to whichever primary the Sentinels name.
    Fresh,
    /// The primary, if it moved (to this address, when a Sentinel announced it): the
    /// connection stays when it did not.
    Moved(Option<String>),
}

/// Listens on one Sentinel after another for `+switch-master` (a failover done): a
/// primary demoted by `SENTINEL FAILOVER` or cut off from the Sentinels may still answer
/// the companion, and go on taking writes the new primary never sees, until Sentinel
/// reconfigures it (some 10 s later): no error tells the companion to move.
async fn watch(primary: std::sync::Weak<Primary>) {
    let Some(sentinels) = primary.upgrade().map(|p| p.sentinels.clone()) else { return };
    for sentinel in sentinels.iter().cycle() {
        let subscribed = tokio::time::timeout(Duration::from_secs(2), async {
            let mut pubsub = sentinel.get_async_pubsub().await?;
            pubsub.subscribe(SWITCH_CHANNEL).await?;
            Ok::<_, RedisError>(pubsub)
        })
        .await;
        if let Ok(Ok(pubsub)) = subscribed {
            let mut messages = pubsub.into_on_message();
            loop {
                // Wakes each second to end with the store it serves.
                let message = match tokio::time::timeout(Duration::from_secs(1), messages.next()).await {
                    Ok(Some(message)) => message,
                    Ok(None) => break, // the Sentinel went away: the next one
                    Err(_) if primary.strong_count() == 0 => return,
                    Err(_) => continue,
                };
                let Some(primary) = primary.upgrade() else { return };
                let payload: String = message.get_payload().unwrap_or_default();
                // "<master-name> <old-ip> <old-port> <new-ip> <new-port>"
                let fields: Vec<&str> = payload.split(' ').collect();
                if let [master, _, _, ip, port] = fields[..] {
                    if master == primary.master {
                        let announced = format!("{ip}:{port}");
                        primary.look_up(Want::Moved(Some(announced)), format!("{SWITCH_CHANNEL} {payload}"));
                    }
                }
            }
        }
        if primary.strong_count() == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Whether a failed call says the primary may have moved: the connection is gone or
/// refused, or the server is no longer a primary (`READONLY`: demoted to replica; a
/// replica that lost its primary: `MASTERDOWN`).
fn moved_on(err: &RedisError) -> bool {
    err.is_io_error()
        || err.is_connection_dropped()
        || err.is_connection_refusal()
        || matches!(err.kind(), ErrorKind::Server(ServerErrorKind::ReadOnly | ServerErrorKind::MasterDown))
        // An error from inside a script keeps the server's code in its text.
        || ["READONLY", "MASTERDOWN"].iter().any(|code| err.to_string().contains(code))
}

/// One look-up: the primary the Sentinels name, checked, and a connection to it.
async fn lookup(
    client: &mut SentinelClient,
    config: &AsyncConnectionConfig,
) -> Result<(MultiplexedConnection, String), RedisError> {
    let found = tokio::time::timeout(LOOKUP_TIMEOUT, async {
        let primary = client.async_get_client().await?;
        let address = primary.get_connection_info().addr().to_string();
        let connection = primary.get_multiplexed_async_connection_with_config(config).await?;
        Ok((connection, address))
    })
    .await;
    match found {
        Ok(result) => result,
        Err(_) => Err(RedisError::from(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("no Sentinel named a primary within {LOOKUP_TIMEOUT:?}"),
        ))),
    }
}

/// Says what a failed look-up means, asking a Sentinel directly when the crate's error
/// does not tell: the Sentinels refused the companion's credentials (`AuthenticationFailed`,
/// naming the Sentinels), none monitors `master` (`InvalidClientConfig`: waiting will not
/// mend it), or the primary they named refused the data nodes' credentials.
async fn explain(master: &str, sentinels: &[redis::Client], err: RedisError) -> RedisError {
    let sentinel_auth = crate::store::is_auth_failure(&err);
    let unknown = err.kind() == ErrorKind::MasterNameNotFoundBySentinel;
    if !(sentinel_auth || unknown) {
        return err;
    }
    for sentinel in sentinels {
        let asked = tokio::time::timeout(Duration::from_secs(2), async {
            let mut connection = sentinel.get_multiplexed_async_connection().await?;
            redis::cmd("SENTINEL").arg("MASTER").arg(master).query_async::<redis::Value>(&mut connection).await
        })
        .await;
        let Ok(asked) = asked else { continue };
        match asked {
            Err(e) if crate::store::is_auth_failure(&e) => {
                return RedisError::from((
                    ErrorKind::AuthenticationFailed,
                    "the Sentinels refused the companion's credentials",
                    format!("{} answered: {e}", sentinel.get_connection_info().addr()),
                ))
            }
            Err(e) if e.to_string().contains("No such master") => {
                return RedisError::from((
                    ErrorKind::InvalidClientConfig,
                    "no Sentinel monitors this master name",
                    format!("{master:?} unknown to {} ({e})", sentinel.get_connection_info().addr()),
                ))
            }
            Ok(_) if sentinel_auth => {
                return RedisError::from((
                    ErrorKind::AuthenticationFailed,
                    "the primary the Sentinels named refused the companion's credentials",
                    err.to_string(),
                ))
            }
            // Known, but down or being failed over: waiting may mend it.
            Ok(_) => return err,
            Err(_) => continue,
        }
    }
    err
}
