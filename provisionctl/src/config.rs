//! The client's configuration file: named contexts, each a way to reach a
//! driver (its address, TLS files, token file), and which one is current, as
//! kubectl's kubeconfig holds clusters.
//!
//! The file is `$XDG_CONFIG_HOME/provisionctl/config.yaml` (or
//! `~/.config/provisionctl/config.yaml`), or `--config`/`PROVISIONCTL_CONFIG`.
//! A flag or an environment variable always wins over the context, and the
//! context over the built-in defaults. The file holds paths, never a token
//! or a key; it is still written owner-only, by rename, so a reader never
//! sees half of it.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::{error::CliError, text::Table};

/// The whole file.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current_context: Option<String>,
    #[serde(default)]
    pub contexts: Vec<Context>,
}

/// One way to reach a driver. Unset fields leave the flag's default.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Context {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_ca: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_cert: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_key: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_file: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub insecure: Option<bool>,
}

/// Where the file is unless `--config` says otherwise: under
/// `$XDG_CONFIG_HOME`, else `~/.config`; `None` without either.
pub fn default_path() -> Option<PathBuf> {
    let base = std::env::var_os("XDG_CONFIG_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME")
                .filter(|v| !v.is_empty())
                .map(|h| PathBuf::from(h).join(".config"))
        })?;
    Some(base.join("provisionctl").join("config.yaml"))
}

impl Config {
    /// The file at `path`; a file that does not exist is an empty config.
    pub fn load(path: &Path) -> Result<Self, CliError> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Self::default()),
            Err(e) => {
                return Err(CliError::Read {
                    path: path.display().to_string(),
                    reason: e.to_string(),
                });
            }
        };
        if text.trim().is_empty() {
            return Ok(Self::default());
        }
        let config: Config = serde_yaml_ng::from_str(&text).map_err(|e| {
            CliError::Other(format!(
                "the configuration file {} cannot be used: {e}",
                path.display()
            ))
        })?;
        let mut seen = std::collections::BTreeSet::new();
        for c in &config.contexts {
            if !seen.insert(c.name.as_str()) {
                return Err(CliError::Other(format!(
                    "the configuration file {} names context {} twice",
                    path.display(),
                    c.name
                )));
            }
        }
        Ok(config)
    }

    /// Writes the file whole (owner-only, by rename).
    pub fn save(&self, path: &Path) -> Result<(), CliError> {
        let fail = |e: std::io::Error| CliError::Other(format!("cannot write {}: {e}", path.display()));
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(fail)?;
        }
        let text = serde_yaml_ng::to_string(self)
            .map_err(|e| CliError::Other(format!("cannot write the configuration: {e}")))?;
        let tmp = path.with_extension(format!("yaml.tmp.{}", std::process::id()));
        let mut options = std::fs::OpenOptions::new();
        options.write(true).create(true).truncate(true);
        #[cfg(unix)]
        {
            use std::os::unix::fs::OpenOptionsExt as _;
            options.mode(0o600);
        }
        {
            use std::io::Write as _;
            let mut f = options.open(&tmp).map_err(fail)?;
            f.write_all(text.as_bytes()).map_err(fail)?;
            f.sync_all().map_err(fail)?;
        }
        std::fs::rename(&tmp, path).map_err(fail)
    }

    pub fn context(&self, name: &str) -> Option<&Context> {
        self.contexts.iter().find(|c| c.name == name)
    }

    /// The context a command uses: `chosen` (`--context`), else the
    /// current one; `None` when neither is set. A name that is not in the
    /// file is an error naming the ones that are.
    pub fn active(&self, chosen: Option<&str>) -> Result<Option<&Context>, CliError> {
        let Some(name) = chosen.or(self.current_context.as_deref()) else {
            return Ok(None);
        };
        self.context(name).map(Some).ok_or_else(|| self.unknown(name))
    }

    fn unknown(&self, name: &str) -> CliError {
        let known: Vec<&str> = self.contexts.iter().map(|c| c.name.as_str()).collect();
        CliError::refused(
            format!("no context named {name} in the configuration"),
            Some(if known.is_empty() {
                "`provisionctl config set-context NAME --server HOST:PORT ...` makes one".to_owned()
            } else {
                format!(
                    "the contexts are: {}; `provisionctl config get-contexts` lists them",
                    known.join(", ")
                )
            }),
        )
    }

    /// Makes `name` the current context.
    pub fn use_context(&mut self, name: &str) -> Result<(), CliError> {
        if self.context(name).is_none() {
            return Err(self.unknown(name));
        }
        self.current_context = Some(name.to_owned());
        Ok(())
    }

    /// Creates the context `update.name`, or sets the fields `update` has on
    /// the existing one. The first context made becomes the current one.
    pub fn set_context(&mut self, update: Context) {
        match self.contexts.iter_mut().find(|c| c.name == update.name) {
            Some(c) => {
                let keep = |new: Option<PathBuf>, old: &mut Option<PathBuf>| {
                    if new.is_some() {
                        *old = new;
                    }
                };
                if update.server.is_some() {
                    c.server = update.server;
                }
                keep(update.tls_ca, &mut c.tls_ca);
                keep(update.tls_cert, &mut c.tls_cert);
                keep(update.tls_key, &mut c.tls_key);
                keep(update.token_file, &mut c.token_file);
                if update.insecure.is_some() {
                    c.insecure = update.insecure;
                }
            }
            None => {
                if self.current_context.is_none() {
                    self.current_context = Some(update.name.clone());
                }
                self.contexts.push(update);
            }
        }
    }

    /// `config get-contexts`.
    pub fn contexts_table(&self) -> Vec<String> {
        if self.contexts.is_empty() {
            return vec!["no contexts".to_owned()];
        }
        let mut t = Table::new(&["CURRENT", "NAME", "SERVER", "TRANSPORT", "TOKEN FILE"]);
        for c in &self.contexts {
            let current = self.current_context.as_deref() == Some(c.name.as_str());
            let transport = match (c.insecure, &c.tls_ca) {
                (Some(true), _) => "plaintext".to_owned(),
                (_, Some(ca)) => format!("TLS, CA {}", ca.display()),
                _ => "-".to_owned(),
            };
            t.row(vec![
                if current { "*" } else { "" }.to_owned(),
                c.name.clone(),
                c.server.clone().unwrap_or_else(|| "-".to_owned()),
                transport,
                c.token_file
                    .as_ref()
                    .map_or_else(|| "-".to_owned(), |p| p.display().to_string()),
            ]);
        }
        t.lines()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    #[test]
    fn contexts_are_made_updated_chosen_and_saved() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub").join("config.yaml");
        let mut c = Config::load(&path).unwrap();
        assert_eq!(c, Config::default(), "a missing file is an empty config");
        assert!(c.active(None).unwrap().is_none());

        c.set_context(Context {
            name: "dev".into(),
            server: Some("127.0.0.1:7000".into()),
            insecure: Some(true),
            ..Context::default()
        });
        c.set_context(Context {
            name: "prod".into(),
            server: Some("driver.prod:7000".into()),
            tls_ca: Some("/etc/p/ca.pem".into()),
            ..Context::default()
        });
        assert_eq!(c.current_context.as_deref(), Some("dev"), "the first is current");
        // An update sets only what it names.
        c.set_context(Context {
            name: "prod".into(),
            token_file: Some("/etc/p/token".into()),
            ..Context::default()
        });
        let prod = c.context("prod").unwrap();
        assert_eq!(prod.server.as_deref(), Some("driver.prod:7000"));
        assert_eq!(prod.token_file.as_deref(), Some(Path::new("/etc/p/token")));

        c.use_context("prod").unwrap();
        let e = c.use_context("staging").unwrap_err().to_string();
        assert!(
            e.contains("no context named staging") && e.contains("dev, prod"),
            "{e}"
        );
        assert_eq!(c.active(None).unwrap().unwrap().name, "prod");
        assert_eq!(c.active(Some("dev")).unwrap().unwrap().name, "dev");
        assert!(c.active(Some("nope")).is_err());

        c.save(&path).unwrap();
        assert_eq!(Config::load(&path).unwrap(), c);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt as _;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o077, 0, "{mode:o}");
        }
        let table = c.contexts_table().join("\n");
        assert!(table.contains("*        prod"), "{table}");
        assert!(
            table.contains("plaintext") && table.contains("TLS, CA /etc/p/ca.pem"),
            "{table}"
        );
    }

    #[test]
    fn a_bad_file_is_named_and_a_context_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.yaml");
        std::fs::write(&path, "contexts:\n  - name: a\n    colour: blue\n").unwrap();
        let e = Config::load(&path).unwrap_err().to_string();
        assert!(e.contains("config.yaml") && e.contains("colour"), "{e}");
        std::fs::write(&path, "contexts:\n  - name: a\n  - name: a\n").unwrap();
        let e = Config::load(&path).unwrap_err().to_string();
        assert!(e.contains("context a twice"), "{e}");
    }
}
