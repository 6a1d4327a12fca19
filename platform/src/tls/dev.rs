//! A development CA and the certificates of the three services and of
//! `provisionctl` (`provisionctl certs`, the demo and the tests).
//!
//! Keys are ECDSA P-256. Each certificate names its holder with the URI SAN
//! `spiffe://provisioning/<name>` (see [`super::identity_of`]); a service's
//! certificate also carries the host names and addresses it is reached at
//! (`localhost`, `127.0.0.1` and `::1` unless told otherwise) and may serve
//! and call (server and client authentication); `provisionctl`'s may only
//! call. The CA's key is not kept: to issue another certificate, generate a
//! new set.

use std::{
    net::IpAddr,
    path::{Path, PathBuf},
    time::{Duration, SystemTime},
};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};

/// The three services, whose certificates may serve and call.
pub const SERVICES: [&str; 3] = ["decider-svc", "executor-svc", "driver-svc"];

/// The command-line client, whose certificate may only call.
pub const CLIENT: &str = "provisionctl";

/// The hosts a service certificate is valid for unless told otherwise.
pub const DEFAULT_HOSTS: [&str; 3] = ["localhost", "127.0.0.1", "::1"];

/// The CA bundle's file name in a directory written by [`write_dev_pki`].
pub const CA_FILE: &str = "ca.pem";

#[derive(Debug, thiserror::Error)]
pub enum DevCertError {
    #[error("generating a certificate: {0}")]
    Generate(#[from] rcgen::Error),
    #[error("{host:?} is not a host name or an IP address")]
    Host { host: String },
    #[error("writing {}: {source}", path.display())]
    Write { path: PathBuf, source: std::io::Error },
}

/// When a certificate is valid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Validity {
    pub not_before: SystemTime,
    pub not_after: SystemTime,
}

impl Validity {
    /// From an hour ago (clocks differ a little) for `days` days.
    pub fn days_from_now(days: u32) -> Self {
        let now = SystemTime::now();
        Self {
            not_before: now.checked_sub(Duration::from_secs(3600)).unwrap_or(now),
            not_after: now + Duration::from_secs(u64::from(days) * 86_400),
        }
    }
}

/// A certificate and its private key, in PEM.
#[derive(Clone)]
pub struct Issued {
    pub cert_pem: String,
    pub key_pem: String,
}

impl std::fmt::Debug for Issued {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Issued").finish_non_exhaustive()
    }
}

/// What a leaf certificate is for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Leaf {
    /// The holder's name: its identity is `spiffe://provisioning/<name>`.
    pub name: String,
    /// Host names and IP addresses a server certificate is valid for;
    /// empty for a client-only certificate.
    pub hosts: Vec<String>,
    /// Whether it may serve (server authentication) besides call.
    pub server: bool,
    pub validity: Validity,
}

impl Leaf {
    /// A service's: serves and calls, for `hosts`.
    pub fn service(name: &str, hosts: &[String], validity: Validity) -> Self {
        Self {
            name: name.to_owned(),
            hosts: hosts.to_vec(),
            server: true,
            validity,
        }
    }

    /// A client's: calls only.
    pub fn client(name: &str, validity: Validity) -> Self {
        Self {
            name: name.to_owned(),
            hosts: Vec::new(),
            server: false,
            validity,
        }
    }
}

/// A certificate authority that lives in memory.
pub struct DevCa {
    issuer: Issuer<'static, KeyPair>,
    cert_pem: String,
}

impl std::fmt::Debug for DevCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DevCa").finish_non_exhaustive()
    }
}

impl DevCa {
    /// A new self-signed CA named `common_name`.
    pub fn new(common_name: &str, validity: Validity) -> Result<Self, DevCertError> {
        let mut params = CertificateParams::default();
        params.distinguished_name = rcgen::DistinguishedName::new();
        params.distinguished_name.push(DnType::CommonName, common_name);
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        params.not_before = validity.not_before.into();
        params.not_after = validity.not_after.into();
        let key = KeyPair::generate()?;
        let cert = params.self_signed(&key)?;
        Ok(Self {
            issuer: Issuer::new(params, key),
            cert_pem: cert.pem(),
        })
    }

    /// The CA certificate: what peers are verified against (`--tls-ca`).
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// Issues a certificate for `leaf` with a fresh key.
    pub fn issue(&self, leaf: &Leaf) -> Result<Issued, DevCertError> {
        let mut params = CertificateParams::default();
        params.distinguished_name = rcgen::DistinguishedName::new();
        params
            .distinguished_name
            .push(DnType::CommonName, leaf.name.as_str());
        params.subject_alt_names = vec![SanType::URI(super::identity_of(&leaf.name).try_into()?)];
        for host in &leaf.hosts {
            let san = match host.parse::<IpAddr>() {
                Ok(ip) => SanType::IpAddress(ip),
                Err(_) => SanType::DnsName(
                    host.clone()
                        .try_into()
                        .map_err(|_| DevCertError::Host { host: host.clone() })?,
                ),
            };
            params.subject_alt_names.push(san);
        }
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = if leaf.server {
            vec![
                ExtendedKeyUsagePurpose::ServerAuth,
                ExtendedKeyUsagePurpose::ClientAuth,
            ]
        } else {
            vec![ExtendedKeyUsagePurpose::ClientAuth]
        };
        params.use_authority_key_identifier_extension = true;
        params.not_before = leaf.validity.not_before.into();
        params.not_after = leaf.validity.not_after.into();
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok(Issued {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }
}

/// The files of one holder in a directory written by [`write_dev_pki`]:
/// `<name>.pem` and `<name>.key`.
pub fn cert_and_key(dir: &Path, name: &str) -> (PathBuf, PathBuf) {
    (dir.join(format!("{name}.pem")), dir.join(format!("{name}.key")))
}

fn write(path: &Path, text: &str, private: bool) -> Result<(), DevCertError> {
    let err = |source| DevCertError::Write {
        path: path.to_owned(),
        source,
    };
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt as _;
        options.mode(if private { 0o600 } else { 0o644 });
    }
    #[cfg(not(unix))]
    let _ = private;
    use std::io::Write as _;
    let mut file = options.open(path).map_err(err)?;
    file.write_all(text.as_bytes()).map_err(err)?;
    // A key file left from before keeps its mode on truncation: set it.
    #[cfg(unix)]
    if private {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(err)?;
    }
    Ok(())
}

/// The files [`write_dev_pki_also`] writes into `dir` for `also`: the CA,
/// then each holder's certificate and key.
pub fn files_of(dir: &Path, also: &[String]) -> Vec<PathBuf> {
    let mut files = vec![dir.join(CA_FILE)];
    for name in SERVICES
        .iter()
        .copied()
        .chain([CLIENT])
        .chain(also.iter().map(String::as_str))
    {
        let (cert, key) = cert_and_key(dir, name);
        files.push(cert);
        files.push(key);
    }
    files
}

/// Writes `issued` into `dir` as `<stem>.pem` and `<stem>.key` (the key
/// readable by the owner only); returns the two paths.
pub fn write_issued(dir: &Path, stem: &str, issued: &Issued) -> Result<(PathBuf, PathBuf), DevCertError> {
    let (cert, key) = cert_and_key(dir, stem);
    write(&cert, &issued.cert_pem, false)?;
    write(&key, &issued.key_pem, true)?;
    Ok((cert, key))
}

/// Writes into `dir` (created if missing) a new CA (`ca.pem`), a certificate
/// and key for each of [`SERVICES`] valid for `hosts`, and a client
/// certificate for [`CLIENT`]; keys are readable by the owner only. Returns
/// the files written.
pub fn write_dev_pki(dir: &Path, hosts: &[String], validity: Validity) -> Result<Vec<PathBuf>, DevCertError> {
    write_dev_pki_also(dir, hosts, &[], validity)
}

/// As [`write_dev_pki`], and a certificate like a service's (serves and
/// calls, valid for `hosts`) for each name in `also`: a store the driver
/// calls over TLS, such as etcd, whose members also call each other.
pub fn write_dev_pki_also(
    dir: &Path,
    hosts: &[String],
    also: &[String],
    validity: Validity,
) -> Result<Vec<PathBuf>, DevCertError> {
    let ca = DevCa::new("provisioning development CA", validity)?;
    let mut written = write_pki_with(&ca, dir, hosts, validity)?;
    for name in also {
        let (cert, key) = write_issued(dir, name, &ca.issue(&Leaf::service(name, hosts, validity))?)?;
        written.push(cert);
        written.push(key);
    }
    Ok(written)
}

/// As [`write_dev_pki`], with a CA the caller keeps (to issue more later).
pub fn write_pki_with(
    ca: &DevCa,
    dir: &Path,
    hosts: &[String],
    validity: Validity,
) -> Result<Vec<PathBuf>, DevCertError> {
    std::fs::create_dir_all(dir).map_err(|source| DevCertError::Write {
        path: dir.to_owned(),
        source,
    })?;
    let mut written = Vec::new();
    let ca_path = dir.join(CA_FILE);
    write(&ca_path, ca.cert_pem(), false)?;
    written.push(ca_path);
    let leaves = SERVICES
        .iter()
        .map(|name| Leaf::service(name, hosts, validity))
        .chain(std::iter::once(Leaf::client(CLIENT, validity)));
    for leaf in leaves {
        let (cert, key) = write_issued(dir, &leaf.name, &ca.issue(&leaf)?)?;
        written.push(cert);
        written.push(key);
    }
    Ok(written)
}
