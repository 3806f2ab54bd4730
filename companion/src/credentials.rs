//! The companion's two rights and the credentials that carry them. The data plane (the
//! filter's charges, leases, settlements, releases, heartbeats, queue and calibration)
//! and administration (usage, reset) take different credentials, so a proxy's token, the
//! one most exposed, cannot read or reset a tenant. Each right takes a list: during a
//! rotation the new and the old credential are both accepted, then the old is removed.

use llm_ratelimit_protocol::credential::weakness;
use std::path::{Path, PathBuf};

/// What a credential allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Right {
    DataPlane,
    Admin,
}

/// The credentials accepted for each right.
pub struct Credentials {
    data_plane: Vec<String>,
    admin: Vec<String>,
}

/// Compares without an early exit, so timing does not reveal how much of a guess matched.
fn same_secret(given: &[u8], expected: &[u8]) -> bool {
    given.len() == expected.len() && given.iter().zip(expected).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
}

/// One right's credentials as given: a comma-separated list (flag or environment), or a
/// file with one per line; `None` if neither.
fn read(
    flag: &str,
    env: &str,
    listed: Option<&str>,
    file_flag: &str,
    file: Option<&Path>,
) -> Result<Option<Vec<String>>, String> {
    let values: Vec<String> = match (listed, file) {
        (Some(listed), None) => listed.split(',').map(|v| v.trim().to_string()).collect(),
        (None, Some(path)) => std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read {file_flag} {}: {e}", path.display()))?
            .lines()
            .map(|line| line.trim().to_string())
            .filter(|line| !line.is_empty() && !line.starts_with('#'))
            .collect(),
        (Some(_), Some(_)) => return Err(format!("give {flag} ({env}) or {file_flag}, not both")),
        (None, None) => return Ok(None),
    };
    if values.is_empty() {
        return Err(format!("{flag} ({env}): no credential given"));
    }
    for (i, value) in values.iter().enumerate() {
        if let Some(reason) = weakness(value) {
            return Err(format!("{flag} ({env}), credential {}: {reason}", i + 1));
        }
    }
    Ok(Some(values))
}

impl Credentials {
    /// The data-plane list is required; without an admin list the admin endpoints refuse
    /// every call. A credential in both lists is refused: it would carry both rights.
    pub fn new(
        token: Option<&str>,
        token_file: Option<&PathBuf>,
        admin: Option<&str>,
        admin_file: Option<&PathBuf>,
    ) -> Result<Credentials, String> {
        let data_plane =
            read("--token", "LLMRL_COMPANION_TOKEN", token, "--token-file", token_file.map(PathBuf::as_path))?
                .ok_or("a data-plane credential is required: set LLMRL_COMPANION_TOKEN or --token-file")?;
        let admin =
            read("--admin-token", "LLMRL_ADMIN_TOKEN", admin, "--admin-token-file", admin_file.map(PathBuf::as_path))?
                .unwrap_or_default();
        if admin.iter().any(|a| data_plane.iter().any(|d| same_secret(a.as_bytes(), d.as_bytes()))) {
            return Err(
                "a credential is both a data-plane --token and an --admin-token: give each right its own".into()
            );
        }
        Ok(Credentials { data_plane, admin })
    }

    /// Whether `given` carries `right` (any credential of its list; each compared whole).
    pub fn allow(&self, right: Right, given: Option<&[u8]>) -> bool {
        let Some(given) = given else { return false };
        let list = match right {
            Right::DataPlane => &self.data_plane,
            Right::Admin => &self.admin,
        };
        list.iter().fold(false, |found, expected| same_secret(given, expected.as_bytes()) | found)
    }

    pub fn has_admin(&self) -> bool {
        !self.admin.is_empty()
    }

    /// How many credentials each right accepts (for the start-up line; never the values).
    pub fn counts(&self) -> (usize, usize) {
        (self.data_plane.len(), self.admin.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NEW: &str = "new-data-plane-0123456789";
    const OLD: &str = "old-data-plane-0123456789";
    const ADMIN: &str = "admin-credential-0123456789";

    #[test]
    fn each_right_takes_its_own_list() {
        let credentials = Credentials::new(Some(&format!("{NEW}, {OLD}")), None, Some(ADMIN), None).expect("valid");
        assert!(credentials.allow(Right::DataPlane, Some(NEW.as_bytes())));
        assert!(credentials.allow(Right::DataPlane, Some(OLD.as_bytes())), "both during a rotation");
        assert!(!credentials.allow(Right::Admin, Some(NEW.as_bytes())), "a proxy's token is no admin's");
        assert!(!credentials.allow(Right::DataPlane, Some(ADMIN.as_bytes())), "nor the other way");
        assert!(credentials.allow(Right::Admin, Some(ADMIN.as_bytes())));
        assert!(!credentials.allow(Right::DataPlane, None));
        assert_eq!(credentials.counts(), (2, 1));
    }

    #[test]
    fn weak_missing_or_shared_credentials_are_refused_naming_the_flag() {
        let refused = |token: Option<&str>, admin: Option<&str>| Credentials::new(token, None, admin, None).err();
        let err = refused(Some("change-me"), None).unwrap_or_default();
        assert!(err.contains("--token (LLMRL_COMPANION_TOKEN), credential 1") && err.contains("placeholder"), "{err}");
        let err = refused(Some(&format!("{NEW},short")), None).unwrap_or_default();
        assert!(err.contains("credential 2") && err.contains("5 bytes"), "{err}");
        let err = refused(Some(NEW), Some("admin")).unwrap_or_default();
        assert!(err.contains("--admin-token (LLMRL_ADMIN_TOKEN)"), "{err}");
        let err = refused(None, Some(ADMIN)).unwrap_or_default();
        assert!(err.contains("data-plane credential is required"), "{err}");
        let err = refused(Some(&format!("{NEW},{ADMIN}")), Some(ADMIN)).unwrap_or_default();
        assert!(err.contains("both"), "{err}");
        assert!(refused(Some(NEW), None).is_none(), "no admin list: the admin endpoints are closed");
    }
}
