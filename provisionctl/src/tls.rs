//! How `provisionctl` reaches the driver (TLS, or plaintext only with
//! `--insecure`) and the `certs` command that writes a development CA and
//! certificates.

use std::path::{Path, PathBuf};

use clap::Args;
use platform::tls::{
    TlsError, TlsMaterial, Transport,
    dev::{self, Validity},
};

use super::error::{CliError, Exit};

/// The TLS flags, global to every command that calls the server.
#[derive(Debug, Clone, Default, Args)]
pub struct TlsClientArgs {
    /// The CA bundle (PEM) the driver's certificate is verified against.
    /// TLS is on when it is given.
    #[arg(long, global = true, env = "PROVISIONCTL_TLS_CA", value_name = "PEM")]
    pub tls_ca: Option<PathBuf>,
    /// A client certificate (PEM) to present to the driver; with --tls-key.
    #[arg(
        long,
        global = true,
        env = "PROVISIONCTL_TLS_CERT",
        value_name = "PEM",
        requires = "tls_key"
    )]
    pub tls_cert: Option<PathBuf>,
    /// The private key (PEM) of --tls-cert.
    #[arg(
        long,
        global = true,
        env = "PROVISIONCTL_TLS_KEY",
        value_name = "PEM",
        requires = "tls_cert"
    )]
    pub tls_key: Option<PathBuf>,
    /// Talk to the driver in plaintext (a driver started with --insecure);
    /// `--insecure=false` overrides a context that says so.
    #[arg(
        long,
        global = true,
        env = "PROVISIONCTL_INSECURE",
        value_parser = clap::builder::BoolishValueParser::new(),
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true",
        value_name = "BOOL"
    )]
    pub insecure: Option<bool>,
}

impl TlsClientArgs {
    /// The transport these flags ask for. Neither `--tls-ca` nor
    /// `--insecure`, or both, is a usage error (exit 2); a file that cannot
    /// be read or holds no PEM fails the command (exit 1).
    pub fn transport(&self) -> Result<Transport, CliError> {
        match (&self.tls_ca, self.insecure.unwrap_or(false)) {
            (None, false) => Err(CliError::Usage(
                "no TLS settings: give --tls-ca (or PROVISIONCTL_TLS_CA) to reach the driver over TLS, \
                 or --insecure for a driver that serves plaintext"
                    .to_owned(),
            )),
            (Some(_), true) => Err(CliError::Usage(
                "--insecure (plaintext) cannot be combined with --tls-ca: choose one".to_owned(),
            )),
            (None, true) => Ok(Transport::Insecure),
            (Some(ca), false) => {
                let identity = match (&self.tls_cert, &self.tls_key) {
                    (Some(cert), Some(key)) => Some((cert.as_path(), key.as_path())),
                    _ => None,
                };
                let material = TlsMaterial::load(ca, identity).map_err(tls_error)?;
                Ok(Transport::Tls(std::sync::Arc::new(material)))
            }
        }
    }
}

/// A TLS setup error as the client reports it.
pub fn tls_error(e: TlsError) -> CliError {
    match e {
        TlsError::Read { what, path, source } => CliError::Read {
            path: path.display().to_string(),
            reason: format!("{source} (it should hold {what})"),
        },
        // The address or its scheme is what the command line said: a usage
        // error, as a missing flag is.
        e @ (TlsError::Url { .. } | TlsError::Scheme { .. }) => CliError::Usage(e.to_string()),
        other => CliError::Other(other.to_string()),
    }
}

/// `provisionctl certs`: writes the development CA and certificates into
/// `out` and says how to use them.
pub fn write_certs(
    out: &Path,
    hosts: &[String],
    also: &[String],
    days: u32,
    force: bool,
) -> Result<Exit, CliError> {
    // A new CA invalidates every certificate issued by the old one: a
    // running stack stops trusting its peers. Never silently.
    let present: Vec<String> = dev::files_of(out, also)
        .into_iter()
        .filter(|p| p.exists())
        .map(|p| p.display().to_string())
        .collect();
    if !present.is_empty() && !force {
        return Err(CliError::refused(
            format!(
                "{} already holds certificates or keys ({}); writing a new CA would leave every holder of the \
                 old ones unable to reach the others",
                out.display(),
                present.join(", ")
            ),
            Some(format!(
                "choose another --out, or give --force to replace them (then restart every service and \
                 client that uses {})",
                out.display()
            )),
        ));
    }
    let written = dev::write_dev_pki_also(out, hosts, also, Validity::days_from_now(days))
        .map_err(|e| CliError::Other(format!("cannot write the certificates: {e}")))?;
    let dir = out.display();
    let mut text = String::new();
    for path in &written {
        text.push_str(&format!("wrote {}\n", path.display()));
    }
    text.push_str(&format!(
        "\nvalid {days} days for {hosts}; identities spiffe://provisioning/<name>.\n\
         Start each service with --tls-ca {dir}/ca.pem --tls-cert {dir}/<service>.pem --tls-key {dir}/<service>.key\n\
         and call the driver with provisionctl --tls-ca {dir}/ca.pem --tls-cert {dir}/provisionctl.pem \
         --tls-key {dir}/provisionctl.key\n",
        hosts = hosts.join(", "),
    ));
    use std::io::Write as _;
    let mut stdout = std::io::stdout().lock();
    match stdout.write_all(text.as_bytes()).and_then(|()| stdout.flush()) {
        Ok(()) => Ok(Exit::Success),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(Exit::Success),
        Err(e) => Err(CliError::Other(format!("cannot write the output: {e}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn written_certificates_load_and_name_their_holders() {
        let dir = tempfile::tempdir().unwrap();
        let hosts: Vec<String> = dev::DEFAULT_HOSTS.iter().map(|h| (*h).to_owned()).collect();
        dev::write_dev_pki(dir.path(), &hosts, Validity::days_from_now(1)).unwrap();
        for name in dev::SERVICES.iter().chain([&dev::CLIENT]) {
            let (cert, key) = dev::cert_and_key(dir.path(), name);
            let material = TlsMaterial::load(&dir.path().join(dev::CA_FILE), Some((&cert, &key))).unwrap();
            assert_eq!(material.names(), [format!("spiffe://provisioning/{name}")]);
            #[cfg(unix)]
            {
                use std::os::unix::fs::PermissionsExt as _;
                let mode = std::fs::metadata(&key).unwrap().permissions().mode();
                assert_eq!(mode & 0o077, 0, "{name}'s key is readable by others: {mode:o}");
            }
        }
    }

    #[test]
    fn also_writes_certificates_from_the_same_ca() {
        let dir = tempfile::tempdir().unwrap();
        let hosts = vec!["*.etcd.provisioning.svc".to_owned()];
        let written = dev::write_dev_pki_also(
            dir.path(),
            &hosts,
            &["etcd".to_owned()],
            Validity::days_from_now(1),
        )
        .unwrap();
        let (cert, key) = dev::cert_and_key(dir.path(), "etcd");
        assert!(written.contains(&cert) && written.contains(&key));
        // Loads beside the CA, and names its holder (the replica tests have
        // etcd members serve with one, verified by the drivers).
        let material = TlsMaterial::load(&dir.path().join(dev::CA_FILE), Some((&cert, &key))).unwrap();
        assert_eq!(material.names(), ["spiffe://provisioning/etcd"]);
    }

    #[test]
    fn a_missing_file_is_named() {
        let args = TlsClientArgs {
            tls_ca: Some("/nonexistent/ca.pem".into()),
            ..TlsClientArgs::default()
        };
        let e = args.transport().unwrap_err();
        assert!(
            matches!(&e, CliError::Read { path, .. } if path == "/nonexistent/ca.pem"),
            "{e}"
        );
    }
}
