//! The driver's store on a filesystem that fills up: a size-limited tmpfs of
//! the test's own (mounted by the test as root, unmounted after). A write
//! that does not fit fails loudly (`UNAVAILABLE`, nothing changed), the run
//! says why (its `Degraded` condition), and once space returns the run goes
//! on with nothing lost.
//!
//! Needs the right to mount (root, or `CAP_SYS_ADMIN`): without it the test
//! fails, naming what it could not do, rather than skip.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use contract::pb;
use provisioning_tests::{
    procs::{Cluster, ClusterOptions, eventually, watch_until},
    shapes::shape,
};
use tonic::Code;

/// A tmpfs mounted at a directory of the test's, unmounted when dropped.
struct SmallDisk {
    at: PathBuf,
}

impl SmallDisk {
    fn mount(at: &Path, size: &str) -> Self {
        std::fs::create_dir_all(at).unwrap();
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(at)
            .output()
            .expect("run mount");
        assert!(
            out.status.success(),
            "cannot mount a {size} tmpfs at {} (the full-disk test needs root or CAP_SYS_ADMIN): {}",
            at.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        Self { at: at.to_owned() }
    }

    /// Fills what is left with one file; returns its path.
    fn fill(&self) -> PathBuf {
        use std::io::Write as _;
        let path = self.at.join("filler");
        let mut f = std::fs::File::create(&path).unwrap();
        let chunk = vec![0u8; 64 << 10];
        loop {
            match f.write_all(&chunk) {
                Ok(()) => {}
                Err(e) if e.raw_os_error() == Some(28) => break, // ENOSPC
                Err(e) => panic!("filling the disk: {e}"),
            }
        }
        // Byte by byte for the last partial chunk.
        while f.write_all(&[0u8]).is_ok() {}
        path
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.at).status();
    }
}

async fn generation(c: &mut pb::provisioning_client::ProvisioningClient<tonic::transport::Channel>) -> u64 {
    c.get_run(pb::GetRunRequest {
        run_id: "disk".into(),
        include_nodes: false,
    })
    .await
    .unwrap()
    .into_inner()
    .generation
}

/// Generation `g` of the run: its three workers carry a large parameter
/// that differs each time, so every apply writes some kilobytes (and
/// replaces the workers).
fn big(g: u64) -> contract::ClusterShape {
    let mut s = shape("disk", g, "fake", &[("workers", 3, "img:1")]);
    let t = std::sync::Arc::make_mut(&mut s.groups[0].template);
    for i in 0..8 {
        t.boot.insert(
            format!("blob{i}"),
            contract::Param {
                value: format!("{g:04}").repeat(1000),
                secret: false,
            },
        );
    }
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_store_halts_the_run_loudly_and_it_resumes_when_space_returns() {
    let scratch = tempfile::tempdir().unwrap();
    let disk = SmallDisk::mount(&scratch.path().join("store"), "16m");
    let opts = ClusterOptions::default().driver("--data-dir", &disk.at.join("driver").display().to_string());
    let cluster = Cluster::start(opts).await.unwrap();
    let mut c = cluster.client().await.unwrap();
    cluster
        .apply(&shape("disk", 1, "fake", &[("workers", 3, "img:1")]))
        .await
        .unwrap();
    watch_until(&mut c, "disk", Duration::from_secs(60), |s| s.converged)
        .await
        .unwrap();

    // No room. The store's file has pages to spare, so a few writes may
    // still fit; once one does not, the change is refused as unavailable,
    // and it changes nothing.
    let filler = disk.fill();
    let mut accepted = 1;
    let mut refusal = None;
    for g in 2..200 {
        match cluster.apply(&big(g)).await {
            Ok(_) => accepted = g,
            Err(e) => {
                refusal = Some(e);
                break;
            }
        }
    }
    let refused = refusal.expect("the full disk never refused a write");
    let code = refused.downcast_ref::<tonic::Status>().map(tonic::Status::code);
    assert_eq!(code, Some(Code::Unavailable), "{refused:#}");
    assert!(format!("{refused:#}").contains("store"), "{refused:#}");
    assert_eq!(
        generation(&mut c).await,
        accepted,
        "a refused apply changed the run"
    );
    // The run says why nothing happens to it.
    let s = c
        .get_run(pb::GetRunRequest {
            run_id: "disk".into(),
            include_nodes: false,
        })
        .await
        .unwrap()
        .into_inner();
    let degraded = s.conditions.iter().find(|c| c.r#type == "Degraded").unwrap();
    assert!(
        degraded.status && degraded.reason == "Halted" && degraded.message.contains("store"),
        "{degraded:?}"
    );
    let next = accepted + 1;

    // Space returns: the run goes on, and the change applies.
    std::fs::remove_file(&filler).unwrap();
    let applied = eventually(Duration::from_secs(60), "the store takes writes again", || {
        let cluster = &cluster;
        async move { cluster.apply(&big(next)).await.ok() }
    })
    .await;
    if let Err(e) = applied {
        cluster.dump_logs();
        panic!("{e}");
    }
    let s = watch_until(&mut c, "disk", Duration::from_secs(60), |s| {
        s.converged && s.generation == next
    })
    .await
    .unwrap();
    assert_eq!(s.ready_count, 3);
    drop(cluster);
    drop(disk);
}

/// The executor's store (fencing epochs, completed results) on a disk that
/// fills: a step whose changes cannot be written sends nothing (a result a
/// driver saw must be one a restarted executor can replay), the executor
/// refuses further work and says so, and restarted once there is room it
/// takes the run to convergence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_executor_store_sends_nothing_unrecorded_and_recovers_on_restart() {
    let scratch = tempfile::tempdir().unwrap();
    let disk = SmallDisk::mount(&scratch.path().join("state"), "16m");
    let opts =
        ClusterOptions::default().executor("--state-dir", &disk.at.join("executor").display().to_string());
    let mut cluster = Cluster::start(opts).await.unwrap();
    let mut c = cluster.client().await.unwrap();
    cluster.apply(&big(1)).await.unwrap();
    watch_until(&mut c, "disk", Duration::from_secs(60), |s| s.converged)
        .await
        .unwrap();

    let filler = disk.fill();
    // Every apply replaces the workers: their operations' results are what
    // the executor must record, and, full, cannot.
    let mut g = 2;
    let refused = eventually(
        Duration::from_secs(60),
        "the executor's store refuses a write",
        || {
            let cluster = &cluster;
            let applied = g;
            g += 1;
            async move {
                let _ = cluster.apply(&big(applied)).await;
                let log = std::fs::read_to_string(cluster.executor.log_file()).unwrap_or_default();
                log.contains("the executor store refused a write")
                    .then_some(applied)
            }
        },
    )
    .await;
    let last = match refused {
        Ok(g) => g,
        Err(e) => {
            cluster.dump_logs();
            panic!("{e}");
        }
    };
    let log = std::fs::read_to_string(cluster.executor.log_file()).unwrap();
    assert!(log.contains("its changes could not be written"), "{log}");
    let s = watch_until(&mut c, "disk", Duration::from_secs(5), |s| s.generation == last)
        .await
        .unwrap();
    assert!(
        !s.converged,
        "converged through an executor that cannot record: {s:?}"
    );

    // Room again, and a restarted executor: the run converges.
    std::fs::remove_file(&filler).unwrap();
    cluster.executor.restart(cluster.dir.path()).await.unwrap();
    watch_until(&mut c, "disk", Duration::from_secs(90), |s| {
        s.converged && s.generation == last
    })
    .await
    .unwrap();
    drop(cluster);
    drop(disk);
}
