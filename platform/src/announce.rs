//! The ready file: where a service says what it bound (port 0 included), so
//! a supervisor or a test reads the address instead of guessing it.

use std::{net::SocketAddr, path::Path};

/// Writes `addr` to `path` by rename, so a reader never sees half a line.
pub fn write_ready_file(path: &Path, addr: SocketAddr) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, format!("{addr}\n"))?;
    std::fs::rename(&tmp, path)
}
