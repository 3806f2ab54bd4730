//! Redis, Valkey, Redis Cluster or Redis behind Sentinel behind one small interface: run a
//! script by SHA (loading it again and retrying once on NOSCRIPT, as after a restart,
//! `SCRIPT FLUSH` or a failover to a replica), and ping. Every call is bounded by the
//! configured timeout.

use prometheus_client::metrics::counter::Counter;
use redis::aio::ConnectionManager;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, Slot, SlotAddr};
use redis::io::tcp::TcpSettings;
use redis::{Cmd, ErrorKind, IntoConnectionInfo, RedisError, ServerErrorKind, TlsCertificates, Value};
use std::sync::Arc;
use std::time::Duration;

/// How the companion proves itself to Redis and checks Redis: ACL user and password (from
/// the environment or a file, or the URL's `user:password@`), those for the Sentinels
/// (`redis+sentinel://`), and for `rediss://` the CA bundle to trust and the client
/// certificate to show (the same for the Sentinels and the data nodes). TLS is rustls (with ring): no
/// system OpenSSL in the image, and one implementation on every platform the companion is
/// built for.
#[derive(Default, Clone)]
pub struct Access {
    pub username: Option<String>,
    pub password: Option<String>,
    /// The Sentinels' own ACL user and password (`requirepass` in sentinel.conf); the
    /// data nodes' are `username` and `password`.
    pub sentinel_username: Option<String>,
    pub sentinel_password: Option<String>,
    /// `rediss://` only; `None`: the system's trust store, no client certificate.
    pub certificates: Option<TlsCertificates>,
}

/// Whether a connection error is one that waiting cannot mend: a wrong password or user,
/// a refused ACL, a TLS setup that does not match the server (certificate, CA, protocol).
pub fn is_fatal(err: &RedisError) -> bool {
    is_auth_failure(err) || err.kind() == ErrorKind::InvalidClientConfig || is_tls_failure(err)
}

/// Redis refused the credentials (WRONGPASS), wants some (NOAUTH), or the user may not run
/// what the companion needs (NOPERM). A cluster client folds its nodes' errors into one of
/// another kind ("Failed to create initial connections - Io: Password authentication
/// failed - AuthenticationFailed"): only the text still says so.
pub fn is_auth_failure(err: &RedisError) -> bool {
    let text = err.to_string();
    err.kind() == ErrorKind::AuthenticationFailed
        || ["WRONGPASS", "NOAUTH", "NOPERM", "unauthenticated", "AuthenticationFailed"]
            .iter()
            .any(|code| text.contains(code))
}

fn is_tls_failure(err: &RedisError) -> bool {
    let text = err.to_string().to_ascii_lowercase();
    ["certificate", "tls", "handshake", "unknownissuer", "pem"].iter().any(|word| text.contains(word))
}

/// Which calls may go in one script call: `None` on one server, a hash slot on a cluster.
pub type Lane = Option<Slot>;

/// A Lua script from `lua/`, with its SHA1 as Redis computes it.
pub struct Script {
    pub name: &'static str,
    pub source: &'static str,
    pub sha: String,
}

impl Script {
    pub fn new(name: &'static str, source: &'static str) -> Script {
        Script { name, source, sha: redis::Script::new(source).get_hash().to_string() }
    }
}

#[derive(Clone)]
enum Connection {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
    /// The primary the Sentinels name, followed across failovers (see `sentinel`).
    Sentinel(Arc<crate::sentinel::Primary>),
}

#[derive(Clone)]
pub struct Store {
    connection: Connection,
    timeout: Duration,
    /// Counts each load after a NOSCRIPT.
    noscript_reloads: Counter,
}

/// Where Redis is: one server, the seed nodes of a cluster, or the Sentinels that name a
/// primary.
#[derive(Debug, Clone, PartialEq)]
pub enum Target {
    Single(String),
    Cluster(Vec<String>),
    Sentinel(Sentinels),
}

/// `redis+sentinel://[user:password@]host:port,host:port/master-name[/db]`: the Sentinels
/// (port 26379 unless given) and the master name they monitor; the URL's user and password
/// are the data nodes' (the Sentinels' have a setting of their own, see `Access`).
#[derive(Clone, PartialEq)]
pub struct Sentinels {
    pub addresses: Vec<(String, u16)>,
    pub master: String,
    pub db: i64,
    /// `rediss+sentinel://`: TLS to the Sentinels and to the data nodes.
    pub tls: bool,
    pub username: Option<String>,
    pub password: Option<String>,
}

impl std::fmt::Debug for Sentinels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sentinels")
            .field("addresses", &self.addresses)
            .field("master", &self.master)
            .field("db", &self.db)
            .field("tls", &self.tls)
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "***"))
            .finish()
    }
}

const DEFAULT_SENTINEL_PORT: u16 = 26379;

impl Sentinels {
    fn parse(rest: &str, tls: bool) -> Result<Sentinels, String> {
        let (auth, rest) = match rest.rsplit_once('@') {
            Some((auth, rest)) => (Some(auth), rest),
            None => (None, rest),
        };
        let (hosts, path) = rest.split_once('/').unwrap_or((rest, ""));
        let (master, db) = match path.trim_end_matches('/').split_once('/') {
            Some((master, db)) => {
                (master, db.parse::<i64>().map_err(|_| format!("the database {db:?} is not a number"))?)
            }
            None => (path.trim_end_matches('/'), 0),
        };
        if master.is_empty() {
            return Err("the Sentinel URL names no master: redis+sentinel://host:port,host:port/<master-name>".into());
        }
        let mut addresses = Vec::new();
        for host in hosts.split(',').map(str::trim).filter(|h| !h.is_empty()) {
            let (name, port) = match host.rsplit_once(':') {
                Some((name, port)) if !name.ends_with(':') => {
                    (name, port.parse::<u16>().map_err(|_| format!("the Sentinel {host:?} has no valid port"))?)
                }
                _ => (host, DEFAULT_SENTINEL_PORT),
            };
            addresses.push((name.trim_start_matches('[').trim_end_matches(']').to_string(), port));
        }
        if addresses.is_empty() {
            return Err("the Sentinel URL lists no Sentinels".into());
        }
        // The user and password as the crate reads a URL's (percent-decoded).
        let (username, password) = match auth {
            Some(auth) => {
                let info = format!("redis://{auth}@localhost").into_connection_info().map_err(|e| e.to_string())?;
                let settings = info.redis_settings();
                (settings.username().map(str::to_string), settings.password().map(str::to_string))
            }
            None => (None, None),
        };
        Ok(Sentinels { addresses, master: master.to_string(), db, tls, username, password })
    }
}

impl Target {
    /// `redis://host:port/db` (or `rediss://`, `unix://`) is one server;
    /// `redis+cluster://h1:p1,h2:p2` (or `rediss+cluster://`) is a cluster's seed list.
    /// `redis+sentinel://h1:p1,h2:p2/master` (or `rediss+sentinel://`) is Redis behind
    /// Sentinel (see `Sentinels`).
    pub fn parse(url: &str) -> Result<Target, String> {
        for (scheme, tls) in [("redis+sentinel://", false), ("rediss+sentinel://", true)] {
            if let Some(rest) = url.strip_prefix(scheme) {
                return Sentinels::parse(rest, tls).map(Target::Sentinel);
            }
        }
        for (cluster_scheme, node_scheme) in [("redis+cluster://", "redis://"), ("rediss+cluster://", "rediss://")] {
            if let Some(rest) = url.strip_prefix(cluster_scheme) {
                let (auth, hosts) = match rest.rsplit_once('@') {
                    Some((auth, hosts)) => (format!("{auth}@"), hosts),
                    None => (String::new(), rest),
                };
                let nodes: Vec<String> = hosts
                    .split(',')
                    .map(str::trim)
                    .filter(|h| !h.is_empty())
                    .map(|h| format!("{node_scheme}{auth}{}", h.trim_end_matches('/')))
                    .collect();
                if nodes.is_empty() {
                    return Err("the cluster URL lists no nodes".into());
                }
                return Ok(Target::Cluster(nodes));
            }
        }
        if ["redis://", "rediss://", "unix://", "redis+unix://"].iter().any(|s| url.starts_with(s)) {
            Ok(Target::Single(url.to_string()))
        } else {
            Err("the Redis URL must start with redis://, rediss://, unix://, redis+cluster://, rediss+cluster://, \
                 redis+sentinel:// or rediss+sentinel://"
                .into())
        }
    }
}

/// The URL as it may be logged: its password, if any, replaced by `***`.
pub fn redacted(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else { return url.to_string() };
    match rest.rsplit_once('@') {
        Some((auth, hosts)) => match auth.split_once(':') {
            Some((user, _)) => format!("{scheme}://{user}:***@{hosts}"),
            None => url.to_string(),
        },
        None => url.to_string(),
    }
}

/// `call`, or a timeout error once `timeout` has passed without its answer.
pub async fn bounded(
    timeout: Duration,
    call: impl std::future::Future<Output = Result<Value, RedisError>>,
) -> Result<Value, RedisError> {
    match tokio::time::timeout(timeout, call).await {
        Ok(result) => result,
        Err(_) => Err(RedisError::from(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("Redis did not answer within {timeout:?}"),
        ))),
    }
}

pub fn is_no_script(err: &RedisError) -> bool {
    err.kind() == ErrorKind::Server(ServerErrorKind::NoScript)
}

impl Store {
    pub async fn connect(target: &Target, access: &Access, timeout: Duration) -> Result<Store, RedisError> {
        // Without TCP_NODELAY (redis-rs leaves it off), a call written while an earlier one
        // is unacknowledged (several in flight on the one multiplexed connection) waits for
        // that acknowledgement: up to a whole script's run, or a delayed ACK.
        let tcp = TcpSettings::default().set_nodelay(true);
        let connection = match target {
            Target::Single(url) => {
                let mut info = url.as_str().into_connection_info()?.set_tcp_settings(tcp);
                let mut settings = info.redis_settings().clone();
                if let Some(username) = &access.username {
                    settings = settings.set_username(username);
                }
                if let Some(password) = &access.password {
                    settings = settings.set_password(password);
                }
                info = info.set_redis_settings(settings);
                let client = match &access.certificates {
                    Some(certificates) => redis::Client::build_with_tls(info, certificates.clone())?,
                    None => redis::Client::open(info)?,
                };
                let config = redis::aio::ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(timeout.max(Duration::from_secs(1))))
                    .set_response_timeout(Some(timeout));
                Connection::Single(client.get_connection_manager_with_config(config).await?)
            }
            Target::Cluster(nodes) => {
                let mut builder = redis::cluster::ClusterClientBuilder::new(nodes.clone());
                if let Some(username) = &access.username {
                    builder = builder.username(username);
                }
                if let Some(password) = &access.password {
                    builder = builder.password(password);
                }
                if let Some(certificates) = &access.certificates {
                    builder = builder.certs(certificates.clone());
                }
                let client = builder
                    .tcp_settings(tcp)
                    .connection_timeout(timeout.max(Duration::from_secs(1)))
                    .response_timeout(timeout)
                    .build()?;
                Connection::Cluster(client.get_async_connection().await?)
            }
            Target::Sentinel(sentinels) => {
                Connection::Sentinel(crate::sentinel::Primary::connect(sentinels, access, timeout).await?)
            }
        };
        Ok(Store { connection, timeout, noscript_reloads: Counter::default() })
    }

    /// Counts NOSCRIPT reloads in `counter` (a metric).
    pub fn counting_reloads_in(self, counter: Counter) -> Store {
        Store { noscript_reloads: counter, ..self }
    }

    pub async fn query(&self, cmd: &Cmd) -> Result<Value, RedisError> {
        match &self.connection {
            Connection::Single(c) => bounded(self.timeout, cmd.query_async(&mut c.clone())).await,
            Connection::Cluster(c) => bounded(self.timeout, cmd.query_async(&mut c.clone())).await,
            // Bounded there: a call's failure (a timeout too) may send it to the Sentinels.
            Connection::Sentinel(primary) => primary.query(cmd, self.timeout).await,
        }
    }

    /// Runs a command that names no key (SCAN) on the server holding `key`'s hash slot:
    /// on one server, that server.
    pub async fn query_on_node_of(&self, key: &str, cmd: &Cmd) -> Result<Value, RedisError> {
        let Connection::Cluster(cluster) = &self.connection else { return self.query(cmd).await };
        let route = Route::with_key(key, SlotAddr::Master);
        let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(route));
        bounded(self.timeout, cluster.clone().route_command(cmd.clone(), routing)).await
    }

    /// SCRIPT LOAD; on a cluster the client sends it to every primary.
    pub async fn load(&self, script: &Script) -> Result<(), RedisError> {
        let sha: Value = self.query(redis::cmd("SCRIPT").arg("LOAD").arg(script.source)).await?;
        match sha {
            Value::BulkString(bytes) if bytes == script.sha.as_bytes() => Ok(()),
            Value::Okay | Value::SimpleString(_) | Value::BulkString(_)
                if matches!(self.connection, Connection::Cluster(_)) =>
            {
                Ok(())
            }
            other => Err(RedisError::from((
                ErrorKind::UnexpectedReturnType,
                "SCRIPT LOAD returned an unexpected SHA",
                format!("{other:?}"),
            ))),
        }
    }

    /// EVALSHA; on NOSCRIPT loads the script and tries once more.
    pub async fn run(&self, script: &Script, keys: &[String], args: &[&str]) -> Result<Value, RedisError> {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(&script.sha).arg(keys.len()).arg(keys).arg(args);
        match self.query(&cmd).await {
            Err(err) if is_no_script(&err) => {
                eprintln!("companion: script {} missing in Redis (NOSCRIPT); loading it again", script.name);
                self.noscript_reloads.inc();
                self.load(script).await?;
                self.query(&cmd).await
            }
            result => result,
        }
    }

    /// Which calls may share a script call with the call whose first key is `key` (every
    /// key of a call shares its hash slot): on one server all, on a cluster those of the
    /// same hash slot, as every key of a script call must be in one slot.
    pub fn lane(&self, key: &str) -> Lane {
        match &self.connection {
            Connection::Single(_) | Connection::Sentinel(_) => None,
            Connection::Cluster(_) => Some(Slot::for_key(key)),
        }
    }

    /// Whether this is a cluster: a script call's keys must then share a hash slot.
    pub fn is_cluster(&self) -> bool {
        matches!(self.connection, Connection::Cluster(_))
    }

    pub async fn ping(&self) -> Result<(), RedisError> {
        self.query(&redis::cmd("PING")).await.map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_single_and_cluster_urls() {
        assert_eq!(Target::parse("redis://127.0.0.1:6379/0"), Ok(Target::Single("redis://127.0.0.1:6379/0".into())));
        assert_eq!(
            Target::parse("redis+cluster://10.0.0.1:7000, 10.0.0.2:7001/"),
            Ok(Target::Cluster(vec!["redis://10.0.0.1:7000".into(), "redis://10.0.0.2:7001".into()]))
        );
        assert_eq!(
            Target::parse("rediss+cluster://user:pw@h1:1,h2:2"),
            Ok(Target::Cluster(vec!["rediss://user:pw@h1:1".into(), "rediss://user:pw@h2:2".into()]))
        );
        assert!(Target::parse("redis+cluster://").is_err());
        assert!(Target::parse("http://localhost:6379").is_err());
    }

    #[test]
    fn parses_sentinel_urls() {
        let Ok(Target::Sentinel(s)) = Target::parse("redis+sentinel://:s3cret@10.0.0.1:26380, 10.0.0.2/mymaster")
        else {
            panic!("not a Sentinel target")
        };
        assert_eq!(s.addresses, [("10.0.0.1".to_string(), 26380), ("10.0.0.2".to_string(), 26379)]);
        assert_eq!((s.master.as_str(), s.db, s.tls), ("mymaster", 0, false));
        assert_eq!((s.username, s.password.as_deref()), (None, Some("s3cret")));
        assert!(!format!("{:?}", Target::parse("redis+sentinel://u:s3cret@h:1/m").unwrap()).contains("s3cret"));
        let Ok(Target::Sentinel(s)) = Target::parse("rediss+sentinel://app:p%40ss@h:1/cache/3/") else { panic!() };
        assert_eq!((s.master.as_str(), s.db, s.tls), ("cache", 3, true));
        assert_eq!((s.username.as_deref(), s.password.as_deref()), (Some("app"), Some("p@ss")));
        assert!(Target::parse("redis+sentinel://h:1").is_err(), "no master name");
        assert!(Target::parse("redis+sentinel://h:1/").is_err(), "no master name");
        assert!(Target::parse("redis+sentinel:///m").is_err(), "no Sentinels");
        assert!(Target::parse("redis+sentinel://h:x/m").is_err(), "bad port");
        assert!(Target::parse("redis+sentinel://h:1/m/x").is_err(), "bad db");
    }

    #[test]
    fn redacts_the_password_of_any_url() {
        assert_eq!(redacted("redis+sentinel://:pw@h1:1,h2:2/m"), "redis+sentinel://:***@h1:1,h2:2/m");
        assert_eq!(redacted("rediss://user:pw@h:1/0"), "rediss://user:***@h:1/0");
        assert_eq!(redacted("redis://h:1"), "redis://h:1");
    }

    #[test]
    fn script_sha_is_redis_sha1() {
        // SHA1 of "return 1", as `SCRIPT LOAD "return 1"` answers.
        assert_eq!(Script::new("one", "return 1").sha, "e0e1f9fabfc9d4800c877a703b823ac0578ff8db");
    }
}
