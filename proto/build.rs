//! Compiles the public API (`provisioning/v1`), the services' internal
//! protocols (`provisioning/internal/v1`) and the driver's records
//! (`provisioning/store/v1`) with the pure-Rust `protox` compiler, so no
//! system `protoc` is needed, and writes the descriptor set used by reflection;
//! compiles the fake backend's control service
//! (`provisioning/fake/v1/fake_control.proto`, a test double) and the provider
//! plugin protocol (`provisioning/provider/v1/provider.proto`) on their own.

use std::{env, fs, path::PathBuf};

use prost::Message;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = PathBuf::from(env::var("CARGO_MANIFEST_DIR")?);
    println!("cargo:rerun-if-changed={}", root.join("provisioning").display());
    if env::var_os("CARGO_FEATURE_WIRE").is_none() {
        return Ok(());
    }
    let out_dir = PathBuf::from(env::var("OUT_DIR")?);
    let fds = protox::compile(
        [
            "provisioning/v1/provisioning.proto",
            "provisioning/internal/v1/decider.proto",
            "provisioning/internal/v1/executor.proto",
            "provisioning/store/v1/store.proto",
        ],
        [&root],
    )?;
    fs::write(out_dir.join("descriptor.bin"), fds.encode_to_vec())?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)?;
    // The fake backend's control service is a test double: compiled on its
    // own, so that it stays out of the descriptor set reflection publishes.
    let fake = protox::compile(["provisioning/fake/v1/fake_control.proto"], [&root])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fake)?;
    // The provider protocol (`provisioning.provider.v1`) is versioned on its
    // own and served by plugins, not by the services: its own descriptor set.
    let provider = protox::compile(["provisioning/provider/v1/provider.proto"], [&root])?;
    fs::write(out_dir.join("provider_descriptor.bin"), provider.encode_to_vec())?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(provider)?;
    Ok(())
}
