//! Tokens and clients for a driver that authenticates its callers
//! (`--tokens-file`; see `driver_svc::auth`).

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
};

use anyhow::Context as _;
use contract::pb::provisioning_client::ProvisioningClient;
use platform::token::{Access, entry_for, new_token};
use provisionctl::token::BearerToken;
use tonic::{service::interceptor::InterceptedService, transport::Channel};

use crate::procs::Cluster;

/// A client of the public API that sends a bearer token (or none).
pub type AuthedClient = ProvisioningClient<InterceptedService<Channel, BearerToken>>;

/// One token to make: its name, its access, and the runs it is limited to
/// (`None`: every run).
#[derive(Debug, Clone)]
pub struct Grant<'a> {
    pub name: &'a str,
    pub access: Access,
    pub runs: Option<&'a [&'a str]>,
}

impl<'a> Grant<'a> {
    pub fn read(name: &'a str) -> Self {
        Self {
            name,
            access: Access::Read,
            runs: None,
        }
    }

    pub fn write(name: &'a str) -> Self {
        Self {
            name,
            access: Access::Write,
            runs: None,
        }
    }

    pub fn only(mut self, runs: &'a [&'a str]) -> Self {
        self.runs = Some(runs);
        self
    }
}

/// A tokens file and the tokens it was made from.
#[derive(Debug)]
pub struct Tokens {
    pub path: PathBuf,
    tokens: BTreeMap<String, String>,
}

impl Tokens {
    /// Makes a fresh token per grant and writes their entries to
    /// `dir/tokens.yaml`.
    pub fn write(dir: &Path, grants: &[Grant<'_>]) -> anyhow::Result<Self> {
        let path = dir.join("tokens.yaml");
        let mut tokens = BTreeMap::new();
        let mut text = String::new();
        for g in grants {
            let token = new_token()?;
            let e = entry_for(
                g.name,
                &token,
                g.access,
                g.runs.map(|r| r.iter().map(|s| (*s).to_owned()).collect()),
            );
            // The file's YAML, written out (names and runs are plain words).
            text.push_str(&format!(
                "- name: {:?}\n  sha256: {}\n  access: {}\n",
                e.name,
                e.sha256.as_deref().unwrap_or_default(),
                e.access
            ));
            if let Some(runs) = &e.runs {
                text.push_str(&format!("  runs: {runs:?}\n"));
            }
            tokens.insert(g.name.to_owned(), token);
        }
        std::fs::write(&path, text)?;
        Ok(Self { path, tokens })
    }

    /// The token named `name`.
    pub fn token(&self, name: &str) -> anyhow::Result<&str> {
        self.tokens
            .get(name)
            .map(String::as_str)
            .with_context(|| format!("no token named {name}"))
    }
}

/// A client of `cluster`'s driver that sends `token` (none: no credentials).
pub async fn client(cluster: &Cluster, token: Option<&str>) -> anyhow::Result<AuthedClient> {
    let bearer = match token {
        Some(t) => BearerToken::new(t).map_err(anyhow::Error::msg)?,
        None => BearerToken::none(),
    };
    Ok(ProvisioningClient::with_interceptor(
        cluster.channel().await?,
        bearer,
    ))
}
