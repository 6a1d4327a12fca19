//! Secret parameter values at rest: sealed with an operator's key before a
//! store writes them, opened when it reads them back.
//!
//! A key file holds 32 bytes, raw or as 64 hex digits, and must not be
//! readable by group or others. A sealed value is
//! `sealed:v1:<hex(nonce ‖ ciphertext ‖ tag)>`, ChaCha20-Poly1305 with a fresh
//! random 96-bit nonce per value; the parameter's name is the associated
//! data, so a sealed value cannot be moved to another parameter unnoticed.
//! Without a key, values are written as they are (the stores keep their files
//! readable by their owner only, and the services warn at start). A sealed
//! value read without a key, or with another key, is an error: the store is
//! refused rather than read half.
//!
//! Only parameters marked secret are sealed; plain values stay readable, so a
//! store stays inspectable.

use std::{collections::HashMap, fmt, path::Path};

use chacha20poly1305::{
    ChaCha20Poly1305, KeyInit, Nonce,
    aead::{Aead, Payload},
};

use contract::pb;

const PREFIX: &str = "sealed:v1:";
const NONCE_LEN: usize = 12;

/// Why a key could not be loaded or a value could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum SecretsError {
    #[error("reading the key file {path}: {error}")]
    Read { path: String, error: String },
    #[error("the key file {path} is readable by group or others (mode {mode:o}); chmod 600 it")]
    Permissions { path: String, mode: u32 },
    #[error("the key file {0} must hold 32 bytes, raw or as 64 hex digits")]
    Format(String),
    #[error("a sealed secret was found but no key is configured (--secrets-key-file)")]
    NoKey,
    #[error("a sealed secret of parameter {0} does not open with this key (wrong key, or damaged)")]
    Open(String),
    #[error("the operating system's random source failed: {0}")]
    Random(String),
}

/// The key secrets are sealed with. Its `Debug` never shows it.
#[derive(Clone)]
pub struct SecretKey([u8; 32]);

impl fmt::Debug for SecretKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SecretKey(..)")
    }
}

impl SecretKey {
    /// Reads a key file: 32 raw bytes, or 64 hex digits (surrounding
    /// whitespace allowed). Refuses a file group or others can read.
    pub fn load(path: &Path) -> Result<Self, SecretsError> {
        let shown = path.display().to_string();
        let read_err = |e: std::io::Error| SecretsError::Read {
            path: shown.clone(),
            error: e.to_string(),
        };
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt as _;
            let mode = std::fs::metadata(path).map_err(read_err)?.permissions().mode();
            if mode & 0o077 != 0 {
                return Err(SecretsError::Permissions {
                    path: shown,
                    mode: mode & 0o777,
                });
            }
        }
        let bytes = std::fs::read(path).map_err(read_err)?;
        Self::from_bytes(&bytes).ok_or(SecretsError::Format(shown))
    }

    /// 32 raw bytes, or 64 hex digits.
    pub fn from_bytes(bytes: &[u8]) -> Option<Self> {
        if let Ok(raw) = <[u8; 32]>::try_from(bytes) {
            return Some(Self(raw));
        }
        let text = std::str::from_utf8(bytes).ok()?.trim();
        if text.len() != 64 {
            return None;
        }
        let mut key = [0u8; 32];
        for (i, k) in key.iter_mut().enumerate() {
            *k = u8::from_str_radix(text.get(2 * i..2 * i + 2)?, 16).ok()?;
        }
        Some(Self(key))
    }

    /// A fresh key from the operating system's random source.
    pub fn generate() -> Result<Self, SecretsError> {
        let mut key = [0u8; 32];
        getrandom::fill(&mut key).map_err(|e| SecretsError::Random(e.to_string()))?;
        Ok(Self(key))
    }

    /// The key as 64 hex digits (what a key file holds).
    pub fn to_hex(&self) -> String {
        hex(&self.0)
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| s.get(i..i + 2).and_then(|d| u8::from_str_radix(d, 16).ok()))
        .collect()
}

/// Seals and opens secret values with an optional key.
#[derive(Clone, Default)]
pub struct Sealer {
    key: Option<SecretKey>,
}

impl fmt::Debug for Sealer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sealer")
            .field("key", &self.key.as_ref().map(|_| ".."))
            .finish()
    }
}

impl Sealer {
    pub fn new(key: Option<SecretKey>) -> Self {
        Self { key }
    }

    /// Whether values are sealed (a key is configured).
    pub fn seals(&self) -> bool {
        self.key.is_some()
    }

    /// Seals one value of parameter `name`; without a key, the value as is.
    pub fn seal(&self, name: &str, value: &str) -> Result<String, SecretsError> {
        let Some(key) = &self.key else {
            return Ok(value.to_owned());
        };
        let mut nonce = [0u8; NONCE_LEN];
        getrandom::fill(&mut nonce).map_err(|e| SecretsError::Random(e.to_string()))?;
        let cipher = ChaCha20Poly1305::new(&key.0.into());
        let sealed = cipher
            .encrypt(
                Nonce::from_slice(&nonce),
                Payload {
                    msg: value.as_bytes(),
                    aad: name.as_bytes(),
                },
            )
            .map_err(|_| SecretsError::Open(name.to_owned()))?;
        let mut out = Vec::with_capacity(NONCE_LEN + sealed.len());
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&sealed);
        Ok(format!("{PREFIX}{}", hex(&out)))
    }

    /// Opens a stored value of parameter `name`. A value that is not sealed
    /// (written without a key) reads as it is.
    pub fn open(&self, name: &str, stored: &str) -> Result<String, SecretsError> {
        let Some(body) = stored.strip_prefix(PREFIX) else {
            return Ok(stored.to_owned());
        };
        let key = self.key.as_ref().ok_or(SecretsError::NoKey)?;
        let bytes = unhex(body).ok_or_else(|| SecretsError::Open(name.to_owned()))?;
        if bytes.len() < NONCE_LEN {
            return Err(SecretsError::Open(name.to_owned()));
        }
        let (nonce, sealed) = bytes.split_at(NONCE_LEN);
        let cipher = ChaCha20Poly1305::new(&key.0.into());
        let plain = cipher
            .decrypt(
                Nonce::from_slice(nonce),
                Payload {
                    msg: sealed,
                    aad: name.as_bytes(),
                },
            )
            .map_err(|_| SecretsError::Open(name.to_owned()))?;
        String::from_utf8(plain).map_err(|_| SecretsError::Open(name.to_owned()))
    }

    /// Seals the secret values of a parameter map in place.
    pub fn seal_params(&self, params: &mut HashMap<String, pb::Param>) -> Result<(), SecretsError> {
        for (name, p) in params.iter_mut().filter(|(_, p)| p.secret) {
            p.value = self.seal(name, &p.value)?;
        }
        Ok(())
    }

    /// Opens the secret values of a parameter map in place.
    pub fn open_params(&self, params: &mut HashMap<String, pb::Param>) -> Result<(), SecretsError> {
        for (name, p) in params.iter_mut().filter(|(_, p)| p.secret) {
            p.value = self.open(name, &p.value)?;
        }
        Ok(())
    }

    /// Seals a template's secret boot and join values in place.
    pub fn seal_template(&self, t: &mut pb::NodeTemplate) -> Result<(), SecretsError> {
        self.seal_params(&mut t.boot)?;
        self.seal_params(&mut t.join)
    }

    pub fn open_template(&self, t: &mut pb::NodeTemplate) -> Result<(), SecretsError> {
        self.open_params(&mut t.boot)?;
        self.open_params(&mut t.join)
    }

    /// Seals what an operation carries: a create's template, a start's boot
    /// and join parameters.
    pub fn seal_operation(&self, op: &mut pb::Operation) -> Result<(), SecretsError> {
        use pb::operation::Input;
        match op.input.as_mut() {
            Some(Input::CreateLease(c)) => match c.template.as_mut() {
                Some(t) => self.seal_template(t),
                None => Ok(()),
            },
            Some(Input::StartBootstrap(s)) => {
                self.seal_params(&mut s.boot)?;
                self.seal_params(&mut s.join)
            }
            _ => Ok(()),
        }
    }

    pub fn open_operation(&self, op: &mut pb::Operation) -> Result<(), SecretsError> {
        use pb::operation::Input;
        match op.input.as_mut() {
            Some(Input::CreateLease(c)) => match c.template.as_mut() {
                Some(t) => self.open_template(t),
                None => Ok(()),
            },
            Some(Input::StartBootstrap(s)) => {
                self.open_params(&mut s.boot)?;
                self.open_params(&mut s.join)
            }
            _ => Ok(()),
        }
    }
}

/// Why a store file could not be opened: the directory or the
/// permissions (`Unavailable`, worth retrying), or the file itself (`Corrupt`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OpenError {
    #[error("{0}")]
    Unavailable(String),
    #[error("{0}")]
    Corrupt(String),
}

/// Opens a store's file `name` in `dir` with `open`: the directory is made if
/// it is missing, and both are then made readable by their owner only (the
/// one way the driver's and the executor's stores open their files).
pub fn open_owner_only<T, E: std::fmt::Display>(
    dir: &Path,
    name: &str,
    open: impl FnOnce(&Path) -> Result<T, E>,
) -> Result<T, OpenError> {
    std::fs::create_dir_all(dir)
        .map_err(|e| OpenError::Unavailable(format!("creating {}: {e}", dir.display())))?;
    let path = dir.join(name);
    let opened = open(&path).map_err(|e| OpenError::Corrupt(format!("opening {}: {e}", path.display())))?;
    for p in [dir, path.as_path()] {
        restrict_to_owner(p)
            .map_err(|e| OpenError::Unavailable(format!("restricting {}: {e}", p.display())))?;
    }
    Ok(opened)
}

/// Makes a store's directory and file readable by their owner only.
pub fn restrict_to_owner(path: &Path) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        let mode = if path.is_dir() { 0o700 } else { 0o600 };
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    fn key() -> SecretKey {
        SecretKey::from_bytes(&[7u8; 32]).unwrap()
    }

    #[test]
    fn a_sealed_value_opens_with_its_key_and_hides_the_plaintext() {
        let s = Sealer::new(Some(key()));
        let sealed = s.seal("token", "hunter2").unwrap();
        assert!(sealed.starts_with(PREFIX));
        assert!(!sealed.contains("hunter2"));
        assert_ne!(
            sealed,
            s.seal("token", "hunter2").unwrap(),
            "fresh nonce per value"
        );
        assert_eq!(s.open("token", &sealed).unwrap(), "hunter2");
    }

    #[test]
    fn another_key_another_name_or_a_flipped_bit_do_not_open() {
        let s = Sealer::new(Some(key()));
        let sealed = s.seal("token", "hunter2").unwrap();
        let other = Sealer::new(Some(SecretKey::from_bytes(&[8u8; 32]).unwrap()));
        assert!(matches!(other.open("token", &sealed), Err(SecretsError::Open(_))));
        assert!(matches!(s.open("password", &sealed), Err(SecretsError::Open(_))));
        let mut damaged = sealed.clone().into_bytes();
        let last = damaged.len() - 1;
        damaged[last] = if damaged[last] == b'0' { b'1' } else { b'0' };
        let damaged = String::from_utf8(damaged).unwrap();
        assert!(matches!(s.open("token", &damaged), Err(SecretsError::Open(_))));
        assert!(matches!(
            Sealer::new(None).open("token", &sealed),
            Err(SecretsError::NoKey)
        ));
    }

    #[test]
    fn without_a_key_values_pass_through_and_unsealed_values_read_as_they_are() {
        let none = Sealer::new(None);
        assert_eq!(none.seal("token", "hunter2").unwrap(), "hunter2");
        assert_eq!(
            Sealer::new(Some(key())).open("token", "hunter2").unwrap(),
            "hunter2"
        );
    }

    #[test]
    fn only_secret_parameters_are_sealed() {
        let s = Sealer::new(Some(key()));
        let mut t = pb::NodeTemplate::default();
        t.boot.insert(
            "token".into(),
            pb::Param {
                value: "hunter2".into(),
                secret: true,
            },
        );
        t.join.insert(
            "greeting".into(),
            pb::Param {
                value: "hello".into(),
                secret: false,
            },
        );
        s.seal_template(&mut t).unwrap();
        assert!(t.boot["token"].value.starts_with(PREFIX));
        assert_eq!(t.join["greeting"].value, "hello");
        s.open_template(&mut t).unwrap();
        assert_eq!(t.boot["token"].value, "hunter2");
    }

    #[test]
    fn key_files_raw_or_hex_and_private() {
        let dir = tempfile_dir();
        let raw = dir.join("raw");
        std::fs::write(&raw, [9u8; 32]).unwrap();
        restrict_to_owner(&raw).unwrap();
        let hexed = dir.join("hex");
        std::fs::write(
            &hexed,
            format!("{}\n", SecretKey::from_bytes(&[9u8; 32]).unwrap().to_hex()),
        )
        .unwrap();
        restrict_to_owner(&hexed).unwrap();
        let a = Sealer::new(Some(SecretKey::load(&raw).unwrap()));
        let b = Sealer::new(Some(SecretKey::load(&hexed).unwrap()));
        assert_eq!(b.open("x", &a.seal("x", "v").unwrap()).unwrap(), "v");

        let short = dir.join("short");
        std::fs::write(&short, "abc").unwrap();
        restrict_to_owner(&short).unwrap();
        assert!(matches!(SecretKey::load(&short), Err(SecretsError::Format(_))));

        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt as _;
            std::fs::set_permissions(&raw, std::fs::Permissions::from_mode(0o644)).unwrap();
            assert!(matches!(
                SecretKey::load(&raw),
                Err(SecretsError::Permissions { .. })
            ));
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn tempfile_dir() -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("secrets-test-{}-{}", std::process::id(), line!()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn a_generated_key_round_trips_through_hex() {
        let k = SecretKey::generate().unwrap();
        let again = SecretKey::from_bytes(k.to_hex().as_bytes()).unwrap();
        assert_eq!(k.0, again.0);
        assert_eq!(format!("{k:?}"), "SecretKey(..)");
    }
}
