//! The real `provisionctl` binary against the three real services: apply
//! (file, stdin, automatic generations, polite refusals), bad files refused
//! before anything is sent, plan, explain, watch (exit codes, plain lines and
//! the in-place view on a pseudo-terminal), get/list in every format, pause
//! and resume, delete --wait, completions.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    path::PathBuf,
    process::Stdio,
    time::{Duration, Instant},
};

use contract::pb;
use provisionctl::render::{Document, Output, parse_document};
use provisioning_tests::procs::{Cluster, ClusterOptions, bin_path};
use tokio::io::AsyncWriteExt;
use tonic::Code;

/// No single invocation may take longer than this; a hang fails the test.
const CALL_LIMIT: Duration = Duration::from_secs(90);

#[derive(Debug)]
struct Out {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Out {
    /// Asserts the exit code, showing both streams when it is wrong.
    fn expect(self, code: i32) -> Self {
        assert_eq!(
            self.code, code,
            "exit {} (wanted {code})\n--- stdout\n{}\n--- stderr\n{}",
            self.code, self.stdout, self.stderr
        );
        self
    }

    fn json(&self) -> Document {
        parse_document(&self.stdout, Output::Json).unwrap_or_else(|e| panic!("{e}:\n{}", self.stdout))
    }

    fn yaml(&self) -> Document {
        parse_document(&self.stdout, Output::Yaml).unwrap_or_else(|e| panic!("{e}:\n{}", self.stdout))
    }
}

struct Ctl {
    bin: PathBuf,
    server: String,
    dir: PathBuf,
    /// TLS settings for the cluster (`PROVISIONCTL_TLS_*`).
    env: Vec<(String, String)>,
}

impl Ctl {
    fn new(cluster: &Cluster) -> Self {
        Self {
            bin: bin_path("provisionctl").unwrap(),
            server: cluster.driver.url(),
            dir: cluster.dir.path().to_path_buf(),
            env: cluster.provisionctl_env(),
        }
    }

    async fn run(&self, args: &[&str]) -> Out {
        self.run_with(args, None).await
    }

    /// What a shell asking `provisionctl` to complete `line` (its last word
    /// the one being completed) is offered, one candidate per line.
    async fn complete(&self, line: &str) -> Vec<String> {
        let words: Vec<&str> = line.split(' ').collect();
        let mut cmd = tokio::process::Command::new(&self.bin);
        cmd.arg("--")
            .args(&words)
            .env("COMPLETE", "bash")
            .env("_CLAP_COMPLETE_INDEX", (words.len() - 1).to_string())
            .env("_CLAP_IFS", "\n")
            .env("PROVISIONCTL_SERVER", &self.server)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .kill_on_drop(true);
        let out = tokio::time::timeout(CALL_LIMIT, cmd.output())
            .await
            .unwrap_or_else(|_| panic!("completing {line:?} hung"))
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let mut got: Vec<String> = String::from_utf8_lossy(&out.stdout)
            .split(['\n', '\u{b}'])
            .filter(|l| !l.is_empty())
            .map(str::to_owned)
            .collect();
        got.sort();
        got
    }

    async fn run_with(&self, args: &[&str], stdin: Option<&str>) -> Out {
        let mut cmd = tokio::process::Command::new(&self.bin);
        cmd.args(args)
            .env("PROVISIONCTL_SERVER", &self.server)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(if stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let mut child = cmd.spawn().unwrap();
        if let Some(input) = stdin {
            let mut pipe = child.stdin.take().unwrap();
            pipe.write_all(input.as_bytes()).await.unwrap();
            drop(pipe);
        }
        let out = tokio::time::timeout(CALL_LIMIT, child.wait_with_output())
            .await
            .unwrap_or_else(|_| panic!("provisionctl {args:?} hung"))
            .unwrap();
        Out {
            code: out.status.code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }

    fn write(&self, name: &str, text: &str) -> String {
        let p = self.dir.join(name);
        std::fs::write(&p, text).unwrap();
        p.display().to_string()
    }
}

const SECRET: &str = "never-print-this-token";

/// A shape file with a control group and a worker group, and a secret.
fn shape(run: &str, workers: u32, worker_image: &str) -> String {
    format!(
        "run_id: {run}
groups:
  - id: ctrl
    count: 2
    template:
      role: control-plane
      image: img:1
      provider: {{ name: fake, machine_type: standard-4, cpu: 4, memory_gib: 16 }}
      join: {{ cluster: {run}, token: {{ value: {SECRET}, secret: true }} }}
  - id: workers
    count: {workers}
    template:
      role: worker
      image: {worker_image}
      provider: {{ name: fake, machine_type: standard-2, cpu: 2, memory_gib: 8 }}
"
    )
}

async fn generation(cluster: &Cluster, run: &str) -> Result<u64, tonic::Status> {
    let mut c = cluster.client().await.unwrap();
    c.get_run(pb::GetRunRequest {
        run_id: run.into(),
        include_nodes: false,
    })
    .await
    .map(|r| r.into_inner().generation)
}

async fn start() -> (Cluster, Ctl) {
    let cluster = Cluster::start(ClusterOptions::default()).await.unwrap();
    let ctl = Ctl::new(&cluster);
    (cluster, ctl)
}

fn no_secret(out: &Out) {
    assert!(
        !out.stdout.contains(SECRET) && !out.stderr.contains(SECRET),
        "a secret was printed:\n{}\n{}",
        out.stdout,
        out.stderr
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apply_from_a_file_and_stdin_with_automatic_generations() {
    let (cluster, ctl) = start().await;
    let file = ctl.write("a.yaml", &shape("alpha", 3, "img:1"));

    let out = ctl.run(&["apply", "-f", &file]).await.expect(0);
    assert!(
        out.stdout.contains("run alpha created at generation 1"),
        "{}",
        out.stdout
    );
    no_secret(&out);
    assert_eq!(generation(&cluster, "alpha").await.unwrap(), 1);

    // The same file again is a no-op, not a new generation.
    let out = ctl.run(&["apply", "-f", &file]).await.expect(0);
    assert!(out.stdout.contains("unchanged at generation 1"), "{}", out.stdout);
    assert_eq!(generation(&cluster, "alpha").await.unwrap(), 1);

    // A change from standard input gets the next generation.
    let out = ctl
        .run_with(
            &["apply", "-f", "-", "-o", "json"],
            Some(&shape("alpha", 4, "img:1")),
        )
        .await
        .expect(0);
    let v = out.json();
    assert_eq!(v["generation"], 2);
    assert_eq!(v["previous_generation"], 1);
    assert_eq!(v["changed"], true);
    assert_eq!(generation(&cluster, "alpha").await.unwrap(), 2);

    // A change of a secret value alone is a change too, although the client
    // cannot see secrets on the server to compare them.
    let rotated = shape("alpha", 4, "img:1").replace(SECRET, "rotated-token");
    let out = ctl
        .run_with(&["apply", "-f", "-"], Some(&rotated))
        .await
        .expect(0);
    assert!(out.stdout.contains("updated to generation 3"), "{}", out.stdout);

    // An explicit generation that is not newer is refused in plain words.
    let stale = format!("generation: 2\n{}", shape("alpha", 5, "img:1"));
    let out = ctl.run_with(&["apply", "-f", "-"], Some(&stale)).await.expect(1);
    assert!(out.stderr.contains("is at generation 3"), "{}", out.stderr);
    assert!(out.stderr.contains("remove `generation:`"), "{}", out.stderr);
    assert!(!out.stderr.contains("FailedPrecondition"), "{}", out.stderr);
    assert_eq!(generation(&cluster, "alpha").await.unwrap(), 3);

    // --expect-generation guards an apply made after a plan.
    let out = ctl
        .run_with(
            &["apply", "-f", "-", "--expect-generation", "2"],
            Some(&shape("alpha", 5, "img:1")),
        )
        .await
        .expect(1);
    assert!(
        out.stderr.contains("is at generation 3, not at generation 2"),
        "{}",
        out.stderr
    );
    assert_eq!(generation(&cluster, "alpha").await.unwrap(), 3);

    // The run converges, and --wait follows it like watch does.
    let out = ctl
        .run_with(
            &["apply", "-f", "-", "--wait", "--timeout", "60"],
            Some(&shape("alpha", 5, "img:1")),
        )
        .await
        .expect(0);
    assert!(out.stdout.contains("converged after"), "{}", out.stdout);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_files_fail_before_anything_is_sent() {
    let (cluster, ctl) = start().await;
    // Three workers, so that `count: 2` names the control group only.
    let good = shape("bad", 3, "img:1");
    let cases: Vec<(&str, String, &str, usize)> = vec![
        (
            "unknown field",
            good.replace("    count: 2\n", "    count: 2\n    colour: blue\n"),
            "unknown field `colour`",
            5,
        ),
        (
            "wrong type",
            good.replace(
                "count: 2\n    template:\n      role: control",
                "count: two\n    template:\n      role: control",
            ),
            "groups[0].count",
            4,
        ),
        (
            "negative count",
            good.replace("count: 3", "count: -3"),
            "groups[1].count must not be negative",
            11,
        ),
        (
            "duplicate group",
            good.replace("id: workers", "id: ctrl"),
            "groups[1].id is a duplicate",
            10,
        ),
        ("syntax error", good.replace("cpu: 4,", "cpu: 4,,"), "", 8),
    ];
    for (what, text, needle, line) in cases {
        let file = ctl.write("bad.yaml", &text);
        let out = ctl.run(&["apply", "-f", &file]).await.expect(1);
        assert!(out.stderr.contains(needle), "{what}: {}", out.stderr);
        assert!(
            out.stderr.contains(&format!("bad.yaml:{line}:")),
            "{what}: no line {line}: {}",
            out.stderr
        );
        assert!(out.stderr.contains("nothing was sent"), "{what}: {}", out.stderr);
        assert_eq!(
            out.stderr.lines().count(),
            2,
            "{what}: one message: {}",
            out.stderr
        );
        no_secret(&out);
        // plan refuses the same file the same way.
        ctl.run(&["plan", "-f", &file]).await.expect(1);
        assert_eq!(
            generation(&cluster, "bad").await.map_err(|s| s.code()),
            Err(Code::NotFound),
            "{what}: the server has the run"
        );
    }
    // The same mistake in JSON, from standard input, is caught too.
    let json = r#"{"run_id": "bad", "groups": [
  {"id": "w", "count": -1, "template": {"image": "i", "provider": {"name": "fake"}}}
]}"#;
    let out = ctl.run_with(&["apply", "-f", "-"], Some(json)).await.expect(1);
    assert!(out.stderr.contains("<stdin>:2:"), "{}", out.stderr);
    assert!(
        out.stderr.contains("groups[0].count must not be negative"),
        "{}",
        out.stderr
    );
    assert_eq!(
        generation(&cluster, "bad").await.map_err(|s| s.code()),
        Err(Code::NotFound)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plan_shows_inserts_scale_down_and_replacements_and_changes_nothing() {
    let (cluster, ctl) = start().await;

    // A new run: every slot is an insert (rule 0).
    let file = ctl.write("p.yaml", &shape("plan", 6, "img:1"));
    let out = ctl.run(&["plan", "-f", &file]).await.expect(0);
    assert!(out.stdout.contains("a new run at generation 1"), "{}", out.stdout);
    assert!(
        out.stdout.contains("insert       6 nodes: workers-0..5"),
        "{}",
        out.stdout
    );
    assert!(out.stdout.contains("rule 0 (insert)"), "{}", out.stdout);
    no_secret(&out);
    let v = ctl
        .run(&["plan", "-f", &file, "-o", "json"])
        .await
        .expect(0)
        .json();
    assert_eq!(v["summary"]["insert"], 8);
    assert!(v["decisions"].as_array().unwrap().iter().all(|d| d["rule"] == 0));
    assert_eq!(
        generation(&cluster, "plan").await.map_err(|s| s.code()),
        Err(Code::NotFound)
    );

    ctl.run(&["apply", "-f", &file, "--wait", "--timeout", "60"])
        .await
        .expect(0);

    // The file just applied changes nothing: said so, at the run's own
    // generation, exit 0 with --detailed-exitcode (2 when there are changes).
    let out = ctl
        .run(&["plan", "-f", &file, "--detailed-exitcode"])
        .await
        .expect(0);
    assert!(
        out.stdout
            .contains("no changes; the run is at generation 1 already"),
        "{}",
        out.stdout
    );
    assert!(
        out.stdout.contains("applying this file would change nothing"),
        "{}",
        out.stdout
    );
    assert!(!out.stdout.contains("~ "), "{}", out.stdout);
    let v = ctl
        .run(&["plan", "-f", &file, "-o", "json"])
        .await
        .expect(0)
        .json();
    assert_eq!(v["changed"], false);
    assert_eq!(v["generation"], 1);

    // Scale down: the highest slots go, with their rule.
    let smaller = ctl.write("p2.yaml", &shape("plan", 3, "img:1"));
    let out = ctl.run(&["plan", "-f", &smaller]).await.expect(0);
    assert!(out.stdout.contains("generation 1 → 2"), "{}", out.stdout);
    assert!(
        out.stdout.contains("group workers: 6 → 3 nodes"),
        "{}",
        out.stdout
    );
    assert!(
        out.stdout
            .contains("scale down   3 nodes: workers-5, workers-4, workers-3"),
        "{}",
        out.stdout
    );
    assert!(
        out.stdout
            .contains("rule 4 (begin-delete): the slot is no longer desired"),
        "{}",
        out.stdout
    );
    let v = ctl
        .run(&["plan", "-f", &smaller, "-o", "yaml"])
        .await
        .expect(0)
        .yaml();
    assert_eq!(v["scale_down"][0], "workers-5");
    assert_eq!(v["summary"]["scale_down"], 3);
    assert_eq!(v["summary"]["unchanged"], 5);
    let planned: Vec<String> = v["scale_down"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_str().unwrap().to_owned())
        .collect();

    // An image change replaces every node of the group (rule 4), and the
    // plan names the field; a changed secret is named, never shown.
    let replaced = ctl.write(
        "p3.yaml",
        &shape("plan", 6, "img:2").replace(SECRET, "another-secret-value"),
    );
    let out = ctl
        .run(&["plan", "-f", &replaced, "--detailed-exitcode"])
        .await
        .expect(2);
    assert!(
        out.stdout
            .contains("group workers: 6 nodes\n  ~ template.image: img:1 → img:2"),
        "{}",
        out.stdout
    );
    assert!(
        out.stdout
            .contains("group ctrl: 2 nodes\n  ~ template.join.token: secret value changed (not shown)"),
        "{}",
        out.stdout
    );
    assert!(!out.stdout.contains("another-secret-value"), "{}", out.stdout);
    let v = ctl
        .run(&["plan", "-f", &replaced, "-o", "json"])
        .await
        .expect(0)
        .json();
    assert_eq!(v["changed"], true);
    assert_eq!(v["field_changes"]["workers"][0]["path"], "template.image");
    let replaced = ctl.write("p3.yaml", &shape("plan", 6, "img:2"));
    let out = ctl.run(&["plan", "-f", &replaced]).await.expect(0);
    // The defaults for 6 nodes: two successors at once (25% rounded up) and
    // one node down (25% rounded down); the rest wait for the budget, in the
    // waves the plan lists.
    assert!(out.stdout.contains("6 to replace"), "{}", out.stdout);
    assert!(
        out.stdout.contains("rule 19 (surge-insert)")
            && out.stdout.contains("rule 17 (rollout-budget)")
            && out.stdout.contains("rollout in 2 waves"),
        "{}",
        out.stdout
    );
    assert!(
        out.stdout.contains("the spec changed: replace the attempt"),
        "{}",
        out.stdout
    );
    assert!(
        out.stdout.contains("unchanged    2 nodes: ctrl-0, ctrl-1"),
        "{}",
        out.stdout
    );
    no_secret(&out);

    // Planning changed nothing.
    assert_eq!(generation(&cluster, "plan").await.unwrap(), 1);

    // The plan matches what then happens, node for node: the slots it named
    // are the ones that go.
    ctl.run(&["apply", "-f", &smaller, "--wait", "--timeout", "60"])
        .await
        .expect(0);
    let v = ctl
        .run(&["get", "plan", "--nodes", "-o", "json"])
        .await
        .expect(0)
        .json();
    let held: Vec<String> = v["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["node_id"].as_str().unwrap().to_owned())
        .collect();
    for gone in &planned {
        assert!(!held.contains(gone), "{gone} still held: {held:?}");
    }
    assert_eq!(held.len(), 5, "{held:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_watch_and_their_exit_codes() {
    // Bootstrap stages a second and a half apart: a good run takes several
    // seconds to converge, long enough to time out and interrupt a watch.
    let cluster = Cluster::start(ClusterOptions::default().executor("--fake-stage-interval-ms", "1500"))
        .await
        .unwrap();
    let ctl = Ctl::new(&cluster);

    // A run that cannot converge: the fake backend refuses `invalid` images
    // for good. Watch sees it stalled and says so at once (exit 5), long
    // before its timeout.
    let broken = ctl.write("broken.yaml", &shape("broken", 2, "invalid:x"));
    ctl.run(&["apply", "-f", &broken]).await.expect(0);
    let t = Instant::now();
    let out = ctl.run(&["watch", "broken", "--timeout", "120"]).await.expect(5);
    assert!(t.elapsed() < Duration::from_secs(60), "{:?}", t.elapsed());
    assert!(out.stderr.contains("run broken is stalled"), "{}", out.stderr);
    assert!(out.stderr.contains("failed permanently"), "{}", out.stderr);
    assert!(out.stderr.contains("invalid image"), "{}", out.stderr);
    assert!(
        out.stderr.contains("provisionctl explain broken"),
        "{}",
        out.stderr
    );
    assert!(out.stdout.contains("failing workers-"), "{}", out.stdout);
    assert!(
        !out.stdout.contains('\x1b'),
        "escapes in plain output: {:?}",
        out.stdout
    );
    // `get` shows the conditions that say why.
    let out = ctl.run(&["get", "broken"]).await.expect(0);
    assert!(out.stdout.contains("CONDITION"), "{}", out.stdout);
    let stalled = out
        .stdout
        .lines()
        .find(|l| l.starts_with("Stalled"))
        .unwrap_or_default();
    assert!(
        stalled.contains("True") && stalled.contains("PermanentFailure"),
        "{}",
        out.stdout
    );
    let v = ctl.run(&["get", "broken", "-o", "json"]).await.expect(0).json();
    let conditions = v["conditions"].as_array().unwrap();
    let types: Vec<&str> = conditions.iter().map(|c| c["type"].as_str().unwrap()).collect();
    assert_eq!(types, ["Ready", "Progressing", "Degraded", "Stalled"]);
    assert_eq!(conditions[0]["status"], false);
    assert_eq!(conditions[3]["status"], true);

    // A run still on its way that does not converge in time: exit 3.
    let slow = ctl.write("slow.yaml", &shape("slow", 3, "img:1"));
    ctl.run(&["apply", "-f", &slow]).await.expect(0);
    let out = ctl.run(&["watch", "slow", "--timeout", "1"]).await.expect(3);
    assert!(out.stderr.contains("did not converge within"), "{}", out.stderr);

    // Ctrl-C ends a watch with 130.
    let mut child = tokio::process::Command::new(&ctl.bin)
        .args(["--server", &ctl.server, "watch", "slow"])
        .envs(ctl.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(700)).await;
    let pid = child.id().unwrap().to_string();
    std::process::Command::new("kill")
        .args(["-INT", &pid])
        .status()
        .unwrap();
    let status = tokio::time::timeout(CALL_LIMIT, child.wait())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(status.code(), Some(130), "{status:?}");

    // Explain says which rule holds the node and why.
    let out = ctl.run(&["explain", "broken", "workers-0"]).await.expect(0);
    assert!(
        out.stdout.contains("now: rule 3 (restart-backoff)"),
        "{}",
        out.stdout
    );
    assert!(out.stdout.contains("permanent failure"), "{}", out.stdout);
    assert!(out.stdout.contains("what to do: "), "{}", out.stdout);
    let v = ctl
        .run(&["explain", "broken", "workers-0", "-o", "json"])
        .await
        .expect(0)
        .json();
    assert_eq!(v["rule_now"]["rule"], 3);
    assert!(
        v["retry"]["permanent_failure"]
            .as_str()
            .unwrap()
            .contains("invalid image")
    );

    // The slow run converges: watch exits 0, and explain shows a ready node.
    let out = ctl.run(&["watch", "slow", "--timeout", "90"]).await.expect(0);
    assert!(out.stdout.contains("run slow converged after"), "{}", out.stdout);
    let out = ctl.run(&["explain", "slow", "ctrl-1"]).await.expect(0);
    assert!(out.stdout.contains("ready, attempt"), "{}", out.stdout);
    assert!(out.stdout.contains("now: rule 11 (ready)"), "{}", out.stdout);
    assert!(out.stdout.contains("lease "), "{}", out.stdout);
    no_secret(&out);

    // Unknown nodes and malformed ids are the user's problem, in words.
    let out = ctl.run(&["explain", "slow", "ctrl-9"]).await.expect(1);
    assert!(
        out.stderr.contains("run slow has no node ctrl-9"),
        "{}",
        out.stderr
    );
    let out = ctl.run(&["explain", "slow", "nonsense"]).await.expect(1);
    assert!(out.stderr.contains("is not a node id"), "{}", out.stderr);
    drop(cluster);
}

/// The in-place view on a real pseudo-terminal (`script` from util-linux
/// provides one), updating and exiting 0 at convergence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_redraws_in_place_on_a_terminal() {
    let (_cluster, ctl) = start().await;
    let file = ctl.write("t.yaml", &shape("tty", 12, "img:1"));
    ctl.run(&["apply", "-f", &file]).await.expect(0);
    let has_script = std::process::Command::new("script")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    let out = if has_script {
        let cmd = format!(
            "{} --server {} watch tty --timeout 60",
            ctl.bin.display(),
            ctl.server
        );
        let mut c = tokio::process::Command::new("script");
        c.args(["-qec", &cmd, "/dev/null"])
            .envs(ctl.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let child = c.spawn().unwrap();
        let o = tokio::time::timeout(CALL_LIMIT, child.wait_with_output())
            .await
            .unwrap()
            .unwrap();
        Out {
            code: o.status.code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
        }
    } else {
        eprintln!("`script` is not installed: forcing the live view with --live instead of a pty");
        ctl.run(&["watch", "tty", "--timeout", "60", "--live"]).await
    };
    let out = out.expect(0);
    assert!(
        out.stdout.contains("\x1b[2K"),
        "no line clearing: {:?}",
        out.stdout
    );
    let redraws = out.stdout.matches("A\r\x1b[2Krun tty").count();
    assert!(
        redraws >= 1,
        "the view never moved up to redraw: {:?}",
        out.stdout
    );
    assert!(
        out.stdout.contains("[####################] 100%"),
        "{:?}",
        out.stdout
    );
    assert!(out.stdout.contains("run tty converged after"), "{:?}", out.stdout);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_in_every_format_pause_resume_and_delete_wait() {
    let (cluster, ctl) = start().await;
    let file = ctl.write("r.yaml", &shape("reads", 4, "img:1"));
    ctl.run(&["apply", "-f", &file, "--wait", "--timeout", "60"])
        .await
        .expect(0);

    let table = ctl.run(&["get", "reads"]).await.expect(0);
    let mut json = ctl.run(&["get", "reads", "-o", "json"]).await.expect(0).json();
    let mut yaml = ctl.run(&["get", "reads", "-o", "yaml"]).await.expect(0).yaml();
    // The two reads are moments apart: the server's clock moved, and a
    // safety-tick pass over the converged run may have counted in between.
    assert!(json["updated_at_ms"].as_u64().unwrap() <= yaml["updated_at_ms"].as_u64().unwrap());
    assert!(json["passes"].as_u64().unwrap() <= yaml["passes"].as_u64().unwrap());
    for moving in ["updated_at_ms", "passes"] {
        json[moving] = Document::Null;
        yaml[moving] = Document::Null;
    }
    assert_eq!(json, yaml, "JSON and YAML carry the same document");
    assert_eq!(json["run_id"], "reads");
    assert_eq!(json["phase"], "converged");
    assert_eq!(json["generation"], 1);
    assert_eq!(json["ready_count"], 6);
    assert_eq!(json["desired_count"], 6);
    assert_eq!(json["groups"][1]["group_id"], "workers");
    assert_eq!(json["groups"][1]["stages"]["ready"], 4);
    assert_eq!(
        json["shape"]["groups"][0]["template"]["join"]["token"]["secret"],
        true
    );
    assert!(table.stdout.contains("6/6 ready"), "{}", table.stdout);
    assert!(
        table.stdout.contains("converged at generation 1"),
        "{}",
        table.stdout
    );
    assert!(table.stdout.contains("workers  4      4"), "{}", table.stdout);
    no_secret(&table);
    let yaml_text = ctl.run(&["get", "reads", "-o", "yaml"]).await.expect(0);
    no_secret(&yaml_text);

    let nodes = ctl
        .run(&["get", "reads", "--nodes", "-o", "json"])
        .await
        .expect(0)
        .json();
    let list = nodes["nodes"].as_array().unwrap();
    assert_eq!(list.len(), 6);
    assert!(
        list.iter()
            .all(|n| n["stage"] == "ready" && n["last_decision"]["rule"] == 11)
    );

    let listed = ctl.run(&["list", "-o", "json"]).await.expect(0).json();
    assert_eq!(listed["runs"][0]["run_id"], "reads");
    let listed = ctl.run(&["list"]).await.expect(0);
    assert!(
        listed
            .stdout
            .lines()
            .any(|l| l.starts_with("reads") && l.contains("6/6")),
        "{}",
        listed.stdout
    );

    // Pause shows in get; resume clears it.
    ctl.run(&["pause", "reads"]).await.expect(0);
    let v = ctl.run(&["get", "reads", "-o", "json"]).await.expect(0).json();
    assert_eq!(v["paused"], true);
    assert_eq!(v["phase"], "paused");
    let out = ctl.run(&["resume", "reads", "-o", "json"]).await.expect(0);
    assert_eq!(out.json()["paused"], false);

    // delete --wait returns once the run is gone.
    let out = ctl
        .run(&["delete", "reads", "--wait", "--timeout", "60"])
        .await
        .expect(0);
    assert!(out.stdout.contains("run reads deleted after"), "{}", out.stdout);
    assert_eq!(
        generation(&cluster, "reads").await.map_err(|s| s.code()),
        Err(Code::NotFound)
    );
    let out = ctl.run(&["get", "reads"]).await.expect(1);
    assert!(out.stderr.contains("run reads does not exist"), "{}", out.stderr);
    assert!(cluster.inventory().await.unwrap().is_empty());
    // Deleting it again: not found (1), unless that is fine (0).
    let out = ctl.run(&["delete", "reads"]).await.expect(1);
    assert!(out.stderr.contains("run reads does not exist"), "{}", out.stderr);
    let out = ctl
        .run(&["delete", "reads", "--ignore-not-found"])
        .await
        .expect(0);
    assert!(out.stdout.contains("nothing to delete"), "{}", out.stdout);
    let v = ctl
        .run(&["delete", "reads", "--ignore-not-found", "-o", "json"])
        .await
        .expect(0)
        .json();
    assert_eq!(v["found"], false);
}

async fn nodes_of(ctl: &Ctl, run: &str) -> Document {
    ctl.run(&["get", run, "--nodes", "-o", "json"])
        .await
        .expect(0)
        .json()
}

/// While paused, nothing new is dispatched: once the operations in flight
/// have been folded, no result arrives and no node moves until resume. Each
/// node is explained along the way, in whatever stage the pause caught it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_stops_dispatch_and_explain_agrees_with_itself() {
    // Slow operations, so that the pause lands mid-run.
    let opts = ClusterOptions::default().executor("--fake-latency-ms", "60,120");
    let cluster = Cluster::start(opts).await.unwrap();
    let ctl = Ctl::new(&cluster);
    let file = ctl.write("p.yaml", &shape("paused", 20, "img:1"));
    ctl.run(&["apply", "-f", &file]).await.expect(0);
    // Paused once the first operations are out, so nodes are caught in
    // several stages.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let v = ctl.run(&["get", "paused", "-o", "json"]).await.expect(0).json();
        if v["pending_operations"].as_u64().unwrap() > 0 || v["ready_count"].as_u64().unwrap() > 0 {
            break;
        }
        assert!(Instant::now() < deadline, "nothing was dispatched: {v}");
    }
    ctl.run(&["pause", "paused"]).await.expect(0);

    let deadline = Instant::now() + Duration::from_secs(30);
    let settled = loop {
        let v = nodes_of(&ctl, "paused").await;
        if v["pending_operations"] == 0 {
            break v;
        }
        assert!(
            Instant::now() < deadline,
            "operations in flight never finished: {v}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(settled["phase"], "paused");
    assert_ne!(
        settled["ready_count"], 22,
        "the pause came too late to test anything"
    );
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let later = nodes_of(&ctl, "paused").await;
    for field in ["folded_results", "ready_count", "pending_operations"] {
        assert_eq!(settled[field], later[field], "{field} moved while paused");
    }
    let stages = |v: &Document| -> Vec<String> {
        v["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n["stage"].to_string())
            .collect()
    };
    assert_eq!(stages(&settled), stages(&later), "a node moved while paused");

    // The text and the JSON of explain say the same, for every stage seen.
    let mut seen = std::collections::BTreeSet::new();
    for n in later["nodes"].as_array().unwrap() {
        let id = n["node_id"].as_str().unwrap();
        let stage = n["stage"].as_str().unwrap();
        if !seen.insert(stage.to_owned()) {
            continue;
        }
        let text = ctl.run(&["explain", "paused", id]).await.expect(0);
        let json = ctl
            .run(&["explain", "paused", id, "-o", "json"])
            .await
            .expect(0)
            .json();
        let rule = json["rule_now"]["rule"].as_u64().unwrap();
        let name = json["rule_now"]["rule_name"].as_str().unwrap();
        assert!(
            text.stdout.contains(&format!("now: rule {rule} ({name})")),
            "{id}: {}",
            text.stdout
        );
        assert!(text.stdout.contains("  stage "), "{}", text.stdout);
        assert!(text.stdout.contains(stage), "{id} at {stage}: {}", text.stdout);
        no_secret(&text);
    }

    let out = ctl.run(&["resume", "paused"]).await.expect(0);
    assert!(out.stdout.contains("resumed"), "{}", out.stdout);
    ctl.run(&["watch", "paused", "--timeout", "60"]).await.expect(0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_help_and_an_unreachable_server() {
    let bin = bin_path("provisionctl").unwrap();
    let run = |args: &[&str]| {
        let o = std::process::Command::new(&bin)
            .args(args)
            .env_remove("PROVISIONCTL_SERVER")
            .output()
            .unwrap();
        (
            o.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&o.stdout).into_owned(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };
    let (code, out, _) = run(&["completions", "bash"]);
    assert_eq!(code, 0);
    assert!(
        out.contains("_clap_complete_provisionctl()") && out.contains("complete -o nospace"),
        "{out}"
    );
    for shell in ["zsh", "fish"] {
        let (code, out, _) = run(&["completions", shell]);
        assert_eq!(code, 0);
        assert!(out.contains("provisionctl"), "{shell}: {out}");
    }
    let (code, out, _) = run(&["--help"]);
    assert_eq!(code, 0);
    assert!(out.contains("Exit codes:"), "{out}");
    let (code, _, err) = run(&["get", "x", "-o", "xml"]);
    assert_eq!(code, 2, "{err}");
    // Usage errors the parser cannot see are told as clap tells its own
    // (the message, then the usage line) and exit 2.
    for (args, says) in [
        (&["list"][..], "no TLS settings: give --tls-ca"),
        (
            &["--insecure", "--tls-ca", "/nonexistent/ca.pem", "list"][..],
            "--insecure (plaintext) cannot be combined with --tls-ca",
        ),
        (
            &[
                "--insecure",
                "apply",
                "-f",
                "/nonexistent/shape.yaml",
                "--timeout",
                "5",
            ][..],
            "apply to following the run: add --wait",
        ),
    ] {
        let (code, _, err) = run(args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.contains(says) && err.contains("Usage:"), "{args:?}: {err}");
    }

    // A port nothing listens on: exit 4, with what to check.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    let (code, _, err) = run(&["--server", &addr.to_string(), "--insecure", "list"]);
    assert_eq!(code, 4, "{err}");
    assert!(
        err.contains("cannot reach the server") && err.contains("PROVISIONCTL_SERVER"),
        "{err}"
    );
}

/// `describe` shows the status, its conditions and the recent events;
/// `events` lists the log (all of it, `--tail`, JSON) and `--follow` prints
/// each event as it is recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_and_describe_say_what_happened() {
    use tokio::io::AsyncBufReadExt;
    let (cluster, ctl) = start().await;
    let broken = ctl.write("ev.yaml", &shape("ev", 2, "invalid:x"));
    ctl.run(&["apply", "-f", &broken]).await.expect(0);
    ctl.run(&["watch", "ev", "--timeout", "60"]).await.expect(5);

    let out = ctl.run(&["describe", "ev"]).await.expect(0);
    no_secret(&out);
    for want in [
        "CONDITION",
        "PermanentFailure",
        "LAST SEEN",
        "NodeFailedPermanently",
        "node/workers-0 (attempt",
        "run created at generation 1",
    ] {
        assert!(out.stdout.contains(want), "no {want:?} in\n{}", out.stdout);
    }
    let v = ctl.run(&["describe", "ev", "-o", "json"]).await.expect(0).json();
    assert!(v["conditions"].is_array() && v["events"].is_array(), "{v}");

    let v = ctl.run(&["events", "ev", "-o", "json"]).await.expect(0).json();
    let all = v["events"].as_array().unwrap().clone();
    let reasons: Vec<&str> = all.iter().map(|e| e["reason"].as_str().unwrap()).collect();
    assert_eq!(reasons.first(), Some(&"Applied"), "{reasons:?}");
    assert_eq!(
        reasons.iter().filter(|r| **r == "NodeFailedPermanently").count(),
        2,
        "{reasons:?}"
    );
    assert!(reasons.contains(&"Stalled"), "{reasons:?}");
    let last = ctl
        .run(&["events", "ev", "--tail", "1", "-o", "json"])
        .await
        .expect(0)
        .json();
    assert_eq!(
        last["events"].as_array().unwrap().as_slice(),
        &all[all.len() - 1..]
    );
    let table = ctl.run(&["events", "ev"]).await.expect(0);
    assert!(
        table.stdout.lines().next().unwrap().starts_with("LAST SEEN"),
        "{}",
        table.stdout
    );
    assert!(table.stdout.contains("Warning"), "{}", table.stdout);

    // Followed: the kept events first, then the fix's as they happen.
    let mut follow = tokio::process::Command::new(&ctl.bin)
        .args(["events", "ev", "--follow", "-o", "json"])
        .env("PROVISIONCTL_SERVER", &ctl.server)
        .envs(ctl.env.iter().map(|(k, v)| (k, v)))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(follow.stdout.take().unwrap()).lines();
    let mut next = async || -> serde_json::Value {
        let line = tokio::time::timeout(CALL_LIMIT, lines.next_line())
            .await
            .expect("no event line in time")
            .unwrap()
            .expect("the follow ended");
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"))
    };
    for e in &all {
        assert_eq!(next().await["seq"], e["seq"]);
    }
    let fixed = ctl.write("ev-fixed.yaml", &shape("ev", 2, "img:1"));
    ctl.run(&["apply", "-f", &fixed]).await.expect(0);
    let applied = next().await;
    assert_eq!(applied["reason"], "Applied", "{applied}");
    assert!(
        applied["message"].as_str().unwrap().contains("generation 2"),
        "{applied}"
    );
    loop {
        let e = next().await;
        if e["reason"] == "Converged" {
            assert_eq!(e["generation"], 2, "{e}");
            break;
        }
    }
    follow.kill().await.unwrap();

    // An unknown run is refused as for `get`.
    let out = ctl.run(&["events", "nope"]).await.expect(1);
    assert!(out.stderr.contains("nope"), "{}", out.stderr);
    drop(cluster);
}

/// A change whose answer is lost (the driver dies between committing it and
/// answering) is reported as of unknown outcome (exit 6), never as refused:
/// after the restart it turns out to have landed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_whose_answer_is_lost_has_an_unknown_outcome() {
    // Apply: the driver aborts right after the shape is stored.
    let mut cluster = Cluster::start(ClusterOptions::default().driver("--crash-at", "apply-committed"))
        .await
        .unwrap();
    let ctl = Ctl::new(&cluster);
    let file = ctl.write("lost.yaml", &shape("lost", 2, "img:1"));
    let out = ctl.run(&["apply", "-f", &file]).await.expect(6);
    assert!(
        out.stderr.contains("the outcome is unknown") && out.stderr.contains("provisionctl get lost"),
        "{}",
        out.stderr
    );
    assert!(!out.stderr.contains("nothing changed"), "{}", out.stderr);
    cluster.driver.restart(cluster.dir.path()).await.unwrap();
    let ctl = Ctl::new(&cluster);
    let v = ctl.run(&["get", "lost", "-o", "json"]).await.expect(0).json();
    assert_eq!(v["generation"], 1, "the apply landed: {v}");
    drop(cluster);

    // Delete: the driver aborts right after the deletion is stored.
    let mut cluster = Cluster::start(ClusterOptions::default().driver("--crash-at", "delete-committed"))
        .await
        .unwrap();
    let ctl = Ctl::new(&cluster);
    let file = ctl.write("lost.yaml", &shape("lost", 2, "img:1"));
    ctl.run(&["apply", "-f", &file, "--wait", "--timeout", "60"])
        .await
        .expect(0);
    let out = ctl.run(&["delete", "lost"]).await.expect(6);
    assert!(out.stderr.contains("the outcome is unknown"), "{}", out.stderr);
    cluster.driver.restart(cluster.dir.path()).await.unwrap();
    let ctl = Ctl::new(&cluster);
    let out = ctl.run(&["get", "lost", "-o", "json"]).await;
    match out.code {
        // Already gone, on its way, or read in its last moment (its final
        // status): either way the delete landed.
        1 => assert!(out.stderr.contains("does not exist"), "{}", out.stderr),
        0 => assert!(
            matches!(out.json()["phase"].as_str(), Some("deleting" | "deleted")),
            "{}",
            out.stdout
        ),
        code => panic!("get exited {code}: {}", out.stderr),
    }

    // A server that is not there was never sent anything: unavailable (4).
    cluster.driver.kill().await.unwrap();
    let out = ctl.run(&["delete", "lost"]).await.expect(4);
    assert!(!out.stderr.contains("outcome is unknown"), "{}", out.stderr);
}

/// The example files agree with each other and with what their headers
/// say: planning `shape-v2.yaml` on a run of `shape.yaml` scales the workers
/// down to 8 (the highest slots go), replaces every gpu node for its new
/// image and leaves everything else alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_change_plans_what_its_header_says() {
    // The examples name the process backend: real agents, killed at the end.
    let agents = provisioning_tests::procs::AgentsDir::new().unwrap();
    let cluster = Cluster::start(
        ClusterOptions::default()
            .executor("--backend", "process")
            .executor("--process-state-dir", &agents.root.display().to_string()),
    )
    .await
    .unwrap();
    let ctl = Ctl::new(&cluster);
    let examples = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/examples");
    let v1 = examples.join("shape.yaml").display().to_string();
    let v2 = examples.join("shape-v2.yaml").display().to_string();
    ctl.run(&["apply", "-f", &v1, "--wait", "--timeout", "60"])
        .await
        .expect(0);
    let v = ctl.run(&["plan", "-f", &v2, "-o", "json"]).await.expect(0).json();
    assert_eq!(v["changed"], true);
    let summary = &v["summary"];
    assert_eq!(
        (
            &summary["insert"],
            &summary["replace"],
            &summary["scale_down"],
            &summary["unchanged"]
        ),
        (&json(0), &json(6), &json(7), &json(11)),
        "{v}"
    );
    let gone: Vec<&str> = v["scale_down"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_str().unwrap())
        .collect();
    let want: Vec<String> = (8..15).rev().map(|i| format!("workers-{i}")).collect();
    assert_eq!(gone, want);
    let changes = v["field_changes"].as_object().unwrap();
    assert_eq!(changes.keys().collect::<Vec<_>>(), ["gpu"], "{v}");
    assert_eq!(v["field_changes"]["gpu"][0]["path"], "template.image");
    assert_eq!(v["field_changes"]["gpu"][0]["new"], "registry.local/node-gpu:1.1");
    drop(cluster);
}

fn json(n: u64) -> serde_json::Value {
    serde_json::Value::from(n)
}

/// `watch` outlives a driver restart: the stream breaks, the client opens
/// it again and follows the run to convergence (exit 0); `--json` prints one
/// status document per line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_follows_a_run_across_a_driver_restart() {
    use tokio::io::AsyncBufReadExt;
    let mut cluster = Cluster::start(ClusterOptions::default().executor("--fake-stage-interval-ms", "700"))
        .await
        .unwrap();
    let ctl = Ctl::new(&cluster);
    let file = ctl.write("w.yaml", &shape("across", 3, "img:1"));
    ctl.run(&["apply", "-f", &file]).await.expect(0);
    let mut watch = tokio::process::Command::new(&ctl.bin)
        .args(["watch", "across", "--timeout", "80", "--json"])
        .env("PROVISIONCTL_SERVER", &ctl.server)
        .envs(ctl.env.iter().map(|(k, v)| (k, v)))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(watch.stdout.take().unwrap()).lines();
    let first = tokio::time::timeout(CALL_LIMIT, lines.next_line())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let first: serde_json::Value = serde_json::from_str(&first).unwrap();
    assert_eq!(first["run_id"], "across");
    assert_eq!(
        first["converged"], false,
        "the run converged before the restart: {first}"
    );
    cluster.driver.restart(cluster.dir.path()).await.unwrap();
    let mut last = first;
    while let Some(line) = tokio::time::timeout(CALL_LIMIT, lines.next_line())
        .await
        .unwrap()
        .unwrap()
    {
        last = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"));
    }
    let out = tokio::time::timeout(CALL_LIMIT, watch.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("watching run across again"), "{stderr}");
    assert_eq!(last["converged"], true, "{last}");
}

/// A context made from the connection flags reaches the driver with no
/// flag or variable at all; a flag still wins over it; an unknown context is
/// refused naming the ones there are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_context_reaches_the_driver_without_flags() {
    let (cluster, ctl) = start().await;
    let config = cluster.dir.path().join("contexts.yaml").display().to_string();
    let run = |args: Vec<String>, with_env: bool| {
        let mut cmd = std::process::Command::new(&ctl.bin);
        cmd.args(&args);
        for (k, _) in std::env::vars() {
            if k.starts_with("PROVISIONCTL_") {
                cmd.env_remove(k);
            }
        }
        if with_env {
            cmd.env("PROVISIONCTL_SERVER", &ctl.server)
                .envs(ctl.env.iter().map(|(k, v)| (k, v)));
        }
        cmd.env("PROVISIONCTL_CONFIG", &config);
        let out = cmd.output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let args = |a: &[&str]| a.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
    let (code, out, err) = run(args(&["config", "set-context", "test"]), true);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("context test made"), "{out}");
    let (_, out, _) = run(args(&["config", "get-contexts"]), false);
    assert!(
        out.contains("*") && out.contains("test") && out.contains(&ctl.server),
        "{out}"
    );

    // No flag, no variable: the context says where and how.
    let file = ctl.write("ctx.yaml", &shape("ctx", 1, "img:1"));
    let (code, _, err) = run(args(&["apply", "-f", &file]), false);
    assert_eq!(code, Some(0), "{err}");
    let (code, out, err) = run(args(&["get", "ctx", "-o", "json"]), false);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("\"run_id\": \"ctx\""), "{out}");
    // A flag wins over the context.
    let (code, _, err) = run(args(&["get", "ctx", "--server", "127.0.0.1:1"]), false);
    assert_eq!(code, Some(4), "{err}");
    // An unknown context names the known ones.
    let (code, _, err) = run(args(&["get", "ctx", "--context", "prod"]), false);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("no context named prod") && err.contains("test"),
        "{err}"
    );
    let (code, _, err) = run(args(&["config", "use-context", "prod"]), false);
    assert_eq!(code, Some(1), "{err}");
    let (code, out, _) = run(args(&["config", "current-context"]), false);
    assert_eq!((code, out.trim()), (Some(0), "test"));
}

/// A shape naming a provider the executor does not serve is refused by the
/// server (this client cannot know what is served): the message points at
/// the line in the file and at `provisionctl providers`, exit 1, nothing
/// created; `providers` lists what is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unserved_provider_is_refused_at_its_line_and_providers_says_what_is_served() {
    let (_cluster, ctl) = start().await;
    let listed = ctl.run(&["providers", "-o", "json"]).await.expect(0).json();
    // Known once the driver's link is up, which may be a moment after start.
    let listed = if listed["known"] == true {
        listed
    } else {
        tokio::time::sleep(std::time::Duration::from_secs(2)).await;
        ctl.run(&["providers", "-o", "json"]).await.expect(0).json()
    };
    assert_eq!(listed["providers"][0]["name"], "fake", "{listed}");
    assert_eq!(listed["providers"][0]["kind"], "builtin", "{listed}");
    let text = shape("elsewhere", 1, "img:1").replace(
        "name: fake, machine_type: standard-2",
        "name: gcp, machine_type: standard-2",
    );
    let file = ctl.write("elsewhere.yaml", &text);
    let out = ctl.run(&["apply", "-f", &file]).await;
    assert_eq!(out.code, 1, "{}", out.stderr);
    assert!(
        out.stderr.contains("elsewhere.yaml:15:")
            && out.stderr.contains("groups[1].template.provider.name")
            && out.stderr.contains("\"gcp\"")
            && out.stderr.contains("serves: fake")
            && out.stderr.contains("provisionctl providers"),
        "{}",
        out.stderr
    );
    ctl.run(&["get", "elsewhere"]).await.expect(1);
}

/// `-o name` and `-o jsonpath=TEMPLATE` for scripts, through the real
/// binary; a format that does not exist is a usage error (exit 2).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn name_and_jsonpath_outputs_for_scripts() {
    let (_cluster, ctl) = start().await;
    let a = ctl.write("a.yaml", &shape("alpha", 1, "img:1"));
    let b = ctl.write("b.yaml", &shape("beta", 1, "img:1"));
    ctl.run(&["apply", "-f", &a]).await.expect(0);
    ctl.run(&["apply", "-f", &b]).await.expect(0);
    let names = ctl.run(&["list", "-o", "name"]).await.expect(0);
    let mut listed: Vec<&str> = names.stdout.lines().collect();
    listed.sort_unstable();
    assert_eq!(listed, ["run/alpha", "run/beta"], "{}", names.stdout);
    let one = ctl.run(&["get", "alpha", "-o", "name"]).await.expect(0);
    assert_eq!(one.stdout, "run/alpha\n");
    let path = ctl
        .run(&["get", "alpha", "-o", "jsonpath={.run_id} at {.generation}"])
        .await
        .expect(0);
    assert_eq!(path.stdout, "alpha at 1\n");
    let ids = ctl
        .run(&["list", "-o", "jsonpath={.runs[*].run_id}"])
        .await
        .expect(0);
    let mut ids: Vec<&str> = ids.stdout.split_whitespace().collect();
    ids.sort_unstable();
    assert_eq!(ids, ["alpha", "beta"]);
    let bad = ctl.run(&["list", "-o", "xml"]).await.expect(2);
    assert!(bad.stderr.contains("jsonpath=TEMPLATE"), "{}", bad.stderr);
    no_secret(&path);
    // `-o wide`: more columns for list, the table for the rest.
    let wide = ctl.run(&["list", "-o", "wide"]).await.expect(0);
    let header = wide.stdout.lines().next().unwrap_or_default();
    assert!(
        header.contains("UID") && header.contains("PASSES") && header.contains("LABELS"),
        "{}",
        wide.stdout
    );
    let get = ctl.run(&["get", "alpha", "-o", "wide"]).await.expect(0);
    assert!(
        get.stdout.starts_with("run ")
            && get.stdout.contains("alpha (uid ")
            && get.stdout.contains("CONDITION"),
        "{}",
        get.stdout
    );
}

/// A read the server sheds is sent again after the pause the server asks
/// for (`grpc-retry-pushback-ms`); a change is never sent twice: shed, it
/// fails at once and says when to try again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_shed_by_the_rate_limit_are_retried_and_changes_are_not() {
    let cluster = Cluster::start(
        ClusterOptions::default()
            .driver("--rate-limit", "2")
            .driver("--rate-limit-window-ms", "1500"),
    )
    .await
    .unwrap();
    let ctl = Ctl::new(&cluster);
    // Two calls use the window up; the third is shed, waits, and succeeds.
    for _ in 0..3 {
        let out = ctl.run(&["list", "-o", "json"]).await.expect(0);
        assert!(out.stderr.is_empty(), "{}", out.stderr);
    }
    // Changes are not retried: use the window up, then a pause is refused.
    ctl.run(&["list"]).await.expect(0);
    ctl.run(&["list"]).await.expect(0);
    let out = ctl.run(&["pause", "nothing-here"]).await.expect(1);
    assert!(
        out.stderr.contains("too busy") && out.stderr.contains("try again in"),
        "{}",
        out.stderr
    );
}

/// Completion offers the driver's run names, and a run's node names, to a
/// shell (`provisionctl completions bash` registers it); an unreachable
/// driver offers nothing, at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completion_offers_run_and_node_names_from_the_driver() {
    let (_cluster, ctl) = start().await;
    for (name, count) in [("alpha", 1), ("alps", 2), ("beta", 1)] {
        let file = ctl.write(&format!("{name}.yaml"), &shape(name, count, "img:1"));
        ctl.run(&["apply", "-f", &file]).await.expect(0);
    }
    assert_eq!(ctl.complete("provisionctl get al").await, ["alpha", "alps"]);
    assert_eq!(ctl.complete("provisionctl describe b").await, ["beta"]);
    assert_eq!(
        ctl.complete("provisionctl explain alps w").await,
        ["workers-0", "workers-1"]
    );
    // An empty word is offered the flags too.
    let offered = ctl.complete("provisionctl explain alps ").await;
    let names: Vec<&String> = offered.iter().filter(|w| !w.starts_with('-')).collect();
    assert_eq!(
        names,
        ["ctrl-0", "ctrl-1", "workers-0", "workers-1"],
        "{offered:?}"
    );
    assert!(offered.iter().any(|w| w == "--output"), "{offered:?}");
    // The script a shell sources names provisionctl as its own completer.
    let script = ctl.run(&["completions", "bash"]).await.expect(0);
    assert!(
        script.stdout.contains("COMPLETE=\"bash\"") && script.stdout.contains("complete -o nospace"),
        "{}",
        script.stdout
    );
    // Nothing to offer from a driver that is not there.
    let away = Ctl {
        server: "http://127.0.0.1:1".to_owned(),
        ..ctl
    };
    assert!(away.complete("provisionctl get al").await.is_empty());
}

/// Run labels: given in the shape file, shown by `get` and `list`,
/// selected by `list -l`; a label change is a new generation that replaces
/// no node; a malformed selector is a usage error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_carry_labels_and_list_selects_by_them() {
    let (_cluster, ctl) = start().await;
    let labelled = |run: &str, labels: &str| format!("labels: {labels}\n{}", shape(run, 1, "img:1"));
    let ml = ctl.write("ml.yaml", &labelled("trainer", "{ team: ml, env: prod }"));
    let web = ctl.write("web.yaml", &labelled("frontend", "{ team: web }"));
    ctl.run(&["apply", "-f", &ml, "--wait", "--timeout", "60"])
        .await
        .expect(0);
    ctl.run(&["apply", "-f", &web]).await.expect(0);
    let plain = ctl.write("plain.yaml", &shape("plain", 1, "img:1"));
    ctl.run(&["apply", "-f", &plain]).await.expect(0);

    let names = |out: Out| {
        let mut n: Vec<String> = out.stdout.lines().map(str::to_owned).collect();
        n.sort();
        n
    };
    assert_eq!(
        names(ctl.run(&["list", "-l", "team=ml", "-o", "name"]).await.expect(0)),
        ["run/trainer"]
    );
    assert_eq!(
        names(ctl.run(&["list", "-l", "team", "-o", "name"]).await.expect(0)),
        ["run/frontend", "run/trainer"]
    );
    assert_eq!(
        names(ctl.run(&["list", "-l", "!team", "-o", "name"]).await.expect(0)),
        ["run/plain"]
    );
    assert_eq!(
        names(
            ctl.run(&["list", "-l", "team!=ml,env!=dev", "-o", "name"])
                .await
                .expect(0)
        ),
        ["run/frontend", "run/plain"]
    );
    let table = ctl.run(&["list"]).await.expect(0);
    assert!(
        table.stdout.contains("LABELS") && table.stdout.contains("env=prod,team=ml"),
        "{}",
        table.stdout
    );
    let got = ctl.run(&["get", "trainer"]).await.expect(0);
    assert!(got.stdout.contains("env=prod,team=ml"), "{}", got.stdout);
    let bad = ctl.run(&["list", "-l", "team=m l"]).await.expect(2);
    assert!(bad.stderr.contains("--selector"), "{}", bad.stderr);

    // A label change: a new generation, the same nodes on the same attempts.
    let before = ctl
        .run(&["get", "trainer", "--nodes", "-o", "json"])
        .await
        .expect(0)
        .json();
    let relabelled = ctl.write("ml2.yaml", &labelled("trainer", "{ team: ml, env: staging }"));
    ctl.run(&["apply", "-f", &relabelled, "--wait", "--timeout", "60"])
        .await
        .expect(0);
    let after = ctl
        .run(&["get", "trainer", "--nodes", "-o", "json"])
        .await
        .expect(0)
        .json();
    assert_eq!(after["generation"], 2, "{after}");
    assert_eq!(after["labels"]["env"], "staging", "{after}");
    let attempts = |v: &serde_json::Value| {
        v["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| (n["node_id"].to_string(), n["attempt"].to_string()))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        attempts(&before),
        attempts(&after),
        "a label change replaced nodes"
    );
    // A bad label is refused locally, naming the field, and sent nowhere.
    let bad = ctl.write("bad.yaml", &labelled("trainer", "{ \"a b\": x }"));
    let out = ctl.run(&["apply", "-f", &bad]).await.expect(1);
    assert!(out.stderr.contains("labels[\"a b\"]"), "{}", out.stderr);
}

/// `delete --wait` of a paused run does not wait for a cleanup that cannot
/// happen: it says the run is paused and how to go on (exit 5), and the
/// delete itself stands; resumed, the run is cleaned up and gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_wait_of_a_paused_run_says_its_cleanup_waits() {
    let (_cluster, ctl) = start().await;
    // Two workers and two control-plane nodes.
    let file = ctl.write("held.yaml", &shape("held", 2, "img:1"));
    ctl.run(&["apply", "-f", &file, "--wait"]).await.expect(0);
    ctl.run(&["pause", "held"]).await.expect(0);
    let out = ctl
        .run(&["delete", "held", "--wait", "--timeout", "1m"])
        .await
        .expect(5);
    assert_eq!(
        out.stdout,
        "run held is being deleted: 4 nodes to clean up\nrun held is paused: nothing is cleaned up until \
         `provisionctl resume held`\n"
    );
    assert_eq!(
        out.stderr,
        "provisionctl: run held is paused, so its cleanup waits: resume it (`provisionctl resume held`), \
         then `provisionctl delete held --wait` waits for it to be gone\n"
    );
    let v = ctl.run(&["get", "held", "-o", "json"]).await.expect(0).json();
    assert_eq!(v["phase"], "deleting", "{v}");
    let ready = v["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "Ready")
        .unwrap();
    assert_eq!(
        (&ready["reason"], &ready["message"]),
        (
            &serde_json::json!("Deleting"),
            &serde_json::json!("being deleted, paused: 4 nodes left to clean up once resumed")
        ),
        "{v}"
    );
    ctl.run(&["resume", "held"]).await.expect(0);
    let out = ctl
        .run(&["delete", "held", "--wait", "--timeout", "1m"])
        .await
        .expect(0);
    assert!(out.stdout.contains("run held deleted after"), "{}", out.stdout);
}
