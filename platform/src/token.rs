//! The bearer-token format the driver and its clients share: what a token
//! grants ([`Access`]), an entry of the driver's tokens file
//! ([`TokenEntry`]), how a token is made ([`new_token`]) and how it is kept
//! (its SHA-256, as hexadecimal: [`hash_token`], [`to_hex`]). The driver's
//! `auth` checks calls against these; `provisionctl token` writes them.

use std::fmt;

use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

/// What a token may do. `Write` includes `Read`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Access {
    Read,
    Write,
}

impl fmt::Display for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Access::Read => "read",
            Access::Write => "write",
        })
    }
}

/// One entry of the tokens file: a token (by its hash) or a client
/// certificate (by its identity), and what it may do.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenEntry {
    /// Who holds the token (logs and per-client limits use it).
    pub name: String,
    /// SHA-256 of the token, 64 hexadecimal digits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
    /// Instead of a token: the identity of a client certificate, a name
    /// (`ops` is `spiffe://provisioning/ops`) or the whole URI.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_cert: Option<String>,
    pub access: Access,
    /// Only these runs; absent: every run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runs: Option<Vec<String>>,
    /// When the entry stops being accepted, RFC 3339 (`2027-01-31T00:00:00Z`);
    /// absent: never.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires: Option<String>,
}

/// An entry's `expires` as the time it names, or why it names none.
pub fn parse_expiry(text: &str) -> Result<std::time::SystemTime, String> {
    humantime::parse_rfc3339_weak(text.trim())
        .map_err(|e| format!("expires {text:?} is not an RFC 3339 time such as 2027-01-31T00:00:00Z ({e})"))
}

/// `t` as an entry's `expires` (RFC 3339, UTC, whole seconds).
pub fn format_expiry(t: std::time::SystemTime) -> String {
    humantime::format_rfc3339_seconds(t).to_string()
}

/// SHA-256 of a token, as the tokens file keeps it.
pub fn hash_token(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

/// `hash` as 64 lowercase hexadecimal digits.
pub fn to_hex(hash: &[u8; 32]) -> String {
    hash.iter().map(|b| format!("{b:02x}")).collect()
}

/// 64 hexadecimal digits as the hash they spell; `None` if they do not.
pub fn parse_hash(s: &str) -> Option<[u8; 32]> {
    let s = s.trim();
    if s.len() != 64 || !s.is_ascii() {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

/// A fresh random token: `prov_` and 64 hexadecimal digits (256 bits from
/// the operating system's generator).
pub fn new_token() -> Result<String, getrandom::Error> {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes)?;
    Ok(format!("prov_{}", to_hex(&bytes)))
}

/// The tokens-file entry for `token`.
pub fn entry_for(name: &str, token: &str, access: Access, runs: Option<Vec<String>>) -> TokenEntry {
    TokenEntry {
        name: name.to_owned(),
        sha256: Some(to_hex(&hash_token(token))),
        client_cert: None,
        access,
        runs,
        expires: None,
    }
}
