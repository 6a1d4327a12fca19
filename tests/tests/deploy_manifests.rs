//! deploy/ against the binaries. No container engine runs here, so the
//! manifests are checked by what they say:
//!
//! - each stack (the Kubernetes manifests, the compose file, the systemd
//!   units) is started from the real binaries with exactly the arguments and
//!   environment it gives, its paths mapped onto temporary directories that
//!   hold what its volumes would (the secrets `deploy/gen-secrets.sh` makes),
//!   its listen ports onto port 0 and its service names onto the bound
//!   addresses; then every service answers its own health probe (the same
//!   files, address and server name as the manifest's `grpc-health-probe`),
//!   and a shape converges and is deleted through `provisionctl` with the
//!   generated token;
//! - every flag and environment variable a manifest names is one the binary
//!   takes (`--help`), or, for the OpenTelemetry SDK's and the log filter's
//!   variables, one the binary reads (its name is in the executable);
//! - ports agree across Deployments, Services, probes, NetworkPolicies, the
//!   compose file, the collector overlay, the systemd units, the Dockerfile
//!   and deploy/telemetry.env, and the NetworkPolicies let only the driver
//!   reach the decider's and the executor's gRPC ports;
//! - `kubernetes-validate` accepts the manifests (and the generated Secrets)
//!   against a pinned Kubernetes schema, and `systemd-analyze verify` the
//!   units.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    collections::{BTreeMap, BTreeSet},
    net::SocketAddr,
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use anyhow::{Context as _, ensure};
use provisioning_tests::procs::{self, Service};
use serde_yaml_ng::Value;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};
use tonic_health::pb::{
    HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
};

/// The services, in the order a stack starts them (the driver calls the other
/// two).
const SERVICES: [&str; 3] = ["decider-svc", "executor-svc", "driver-svc"];

/// The Kubernetes version whose schema the manifests are validated against.
const KUBERNETES_VERSION: &str = "1.33.0";

/// What `.ci/run` installs (keep the two in step).
const KUBERNETES_VALIDATE_VERSION: &str = "1.37.0";

/// The flags of `grpc-health-probe` (the version the Dockerfile pins).
const PROBE_FLAGS: [&str; 10] = [
    "addr",
    "service",
    "connect-timeout",
    "rpc-timeout",
    "tls",
    "tls-no-verify",
    "tls-ca-cert",
    "tls-client-cert",
    "tls-client-key",
    "tls-server-name",
];

/// The executable the probes run.
const PROBE: &str = "grpc-health-probe";

// ---------------------------------------------------------------------------
// Files and YAML

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

fn deploy(rel: &str) -> PathBuf {
    repo().join("deploy").join(rel)
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every document of a multi-document YAML file (empty ones left out).
fn yaml_docs(path: &Path) -> Vec<Value> {
    let text = read(path);
    let mut docs = Vec::new();
    let mut current = String::new();
    let mut push = |text: &str| {
        let doc: Value = serde_yaml_ng::from_str(text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        if !doc.is_null() {
            docs.push(doc);
        }
    };
    for line in text.lines() {
        if line.trim_end() == "---" {
            push(&current);
            current.clear();
        } else {
            current.push_str(line);
            current.push('\n');
        }
    }
    push(&current);
    docs
}

fn yaml(path: &Path) -> Value {
    serde_yaml_ng::from_str(&read(path)).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn st(v: &Value) -> Option<&str> {
    v.as_str()
}

fn seq(v: &Value) -> &[Value] {
    v.as_sequence().map(Vec::as_slice).unwrap_or(&[])
}

fn strings(v: &Value) -> Vec<String> {
    seq(v)
        .iter()
        .map(|x| match x {
            Value::String(s) => s.clone(),
            Value::Number(n) => n.to_string(),
            Value::Bool(b) => b.to_string(),
            other => panic!("expected a scalar, found {other:?}"),
        })
        .collect()
}

/// A string-to-string map (labels, ConfigMap data, compose environment).
fn string_map(v: &Value) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    if let Some(m) = v.as_mapping() {
        for (k, v) in m {
            let k = st(k).expect("a string key").to_owned();
            let v = match v {
                Value::String(s) => s.clone(),
                Value::Number(n) => n.to_string(),
                Value::Bool(b) => b.to_string(),
                other => panic!("{k}: expected a scalar, found {other:?}"),
            };
            out.insert(k, v);
        }
    }
    out
}

/// `(host, port)` of `[scheme://]host:port[/]`, if the text is an address.
fn parse_addr(text: &str) -> Option<(String, String, u16)> {
    let (scheme, rest) = match text.split_once("://") {
        Some((s, r)) => (format!("{s}://"), r),
        None => (String::new(), text),
    };
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    let (host, port) = rest.rsplit_once(':')?;
    let port: u16 = port.parse().ok()?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let ok = !host.is_empty()
        && host
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '.' || c == '-' || c == ':');
    ok.then(|| (scheme, host.to_owned(), port))
}

// ---------------------------------------------------------------------------
// What a deployment source says about one service

/// What backs a path a service sees.
#[derive(Debug, Clone)]
enum Backing {
    /// An empty, writable directory (emptyDir, a PersistentVolumeClaim, tmpfs,
    /// a systemd StateDirectory).
    Empty,
    /// A Kubernetes Secret volume: its keys (or `items`) as files.
    Secret {
        secret: String,
        items: Option<Vec<(String, String)>>,
        mode: u32,
    },
    /// A path on the host, relative to the generated secrets directory
    /// (compose bind mounts of `${PROVISIONING_SECRETS}/...`, systemd's
    /// /etc/provisioning).
    Secrets(String),
}

#[derive(Debug, Clone)]
struct Mount {
    /// The path inside the container (or on the host, for systemd).
    at: String,
    /// The pod volume (or bind mount) it shows.
    volume: String,
}

#[derive(Debug, Clone)]
struct Launch {
    /// Where it was read from, for messages.
    source: String,
    binary: String,
    args: Vec<String>,
    env: Vec<(String, String)>,
    mounts: Vec<Mount>,
    /// Commands run before the service (Kubernetes init containers), with
    /// their own mounts of the same volumes.
    init: Vec<(Vec<String>, Vec<Mount>)>,
    /// The health probe's arguments (after `grpc-health-probe`).
    probe: Option<Vec<String>>,
}

impl Launch {
    fn flag(&self, name: &str) -> Option<&str> {
        flag_value(&self.args, name)
    }

    fn port_of(&self, flag: &str) -> u16 {
        let v = self
            .flag(flag)
            .unwrap_or_else(|| panic!("{}: {} has no {flag}", self.source, self.binary));
        parse_addr(v)
            .unwrap_or_else(|| panic!("{}: {flag} {v} is not host:port", self.source))
            .2
    }

    fn grpc_port(&self) -> u16 {
        self.port_of("--listen")
    }

    fn metrics_port(&self) -> u16 {
        self.port_of("--metrics-listen")
    }
}

/// The value of `--name value` or `--name=value`.
fn flag_value<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if a == name {
            return it.next().map(String::as_str);
        }
        if let Some(v) = a.strip_prefix(name).and_then(|r| r.strip_prefix('=')) {
            return Some(v);
        }
    }
    None
}

/// One deployment source's services and the names they are reached by.
#[derive(Debug, Clone)]
struct Stack {
    name: &'static str,
    volumes: BTreeMap<String, Backing>,
    services: Vec<Launch>,
    /// `(host, port)` a client dials → `(binary, container port)`.
    names: BTreeMap<(String, u16), (String, u16)>,
    /// Whether the host names belong to the stack alone (a Service or
    /// compose name), so that another port on them is a mistake; on one host
    /// (systemd) other things listen on localhost too.
    own_hosts: bool,
}

impl Stack {
    fn service(&self, binary: &str) -> &Launch {
        self.services
            .iter()
            .find(|l| l.binary == binary)
            .unwrap_or_else(|| panic!("{}: no {binary}", self.name))
    }
}

// ---------------------------------------------------------------------------
// Kubernetes

struct K8s {
    docs: Vec<(String, Value)>,
}

impl K8s {
    fn load() -> Self {
        let mut files: Vec<PathBuf> = std::fs::read_dir(deploy("k8s"))
            .expect("deploy/k8s")
            .map(|e| e.expect("a directory entry").path())
            .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
            .collect();
        files.sort();
        assert!(!files.is_empty(), "deploy/k8s has manifests");
        let docs = files
            .iter()
            .flat_map(|f| {
                let name = f.file_name().unwrap_or_default().to_string_lossy().into_owned();
                yaml_docs(f).into_iter().map(move |d| (name.clone(), d))
            })
            .collect();
        Self { docs }
    }

    fn of_kind<'a>(&'a self, kind: &str) -> impl Iterator<Item = &'a Value> + 'a {
        let kind = kind.to_owned();
        self.docs
            .iter()
            .map(|(_, d)| d)
            .filter(move |d| st(&d["kind"]) == Some(kind.as_str()))
    }

    fn named(&self, kind: &str, name: &str) -> &Value {
        self.of_kind(kind)
            .find(|d| st(&d["metadata"]["name"]) == Some(name))
            .unwrap_or_else(|| panic!("no {kind} named {name} in deploy/k8s"))
    }

    fn deployments(&self) -> Vec<&Value> {
        self.of_kind("Deployment").collect()
    }

    /// The Deployment whose container runs `binary`.
    fn deployment_of(&self, binary: &str) -> &Value {
        self.of_kind("Deployment")
            .find(|d| binary_of_image(&main_container(d)["image"]) == binary)
            .unwrap_or_else(|| panic!("no Deployment runs {binary}"))
    }
}

fn main_container(deployment: &Value) -> &Value {
    let containers = seq(&deployment["spec"]["template"]["spec"]["containers"]);
    assert_eq!(
        containers.len(),
        1,
        "{:?}: one container per pod",
        deployment["metadata"]["name"]
    );
    &containers[0]
}

fn pod_labels(deployment: &Value) -> BTreeMap<String, String> {
    string_map(&deployment["spec"]["template"]["metadata"]["labels"])
}

/// Whether a `matchLabels` selector (`{}` selects everything) selects `labels`.
fn selects(selector: &Value, labels: &BTreeMap<String, String>) -> bool {
    string_map(&selector["matchLabels"])
        .iter()
        .all(|(k, v)| labels.get(k) == Some(v))
        && seq(&selector["matchExpressions"]).is_empty()
}

/// `provisioning/<binary>:<tag>` → `<binary>`.
fn binary_of_image(image: &Value) -> String {
    let image = st(image).expect("an image");
    let name = image.rsplit('/').next().unwrap_or(image);
    name.split(':').next().unwrap_or(name).to_owned()
}

/// Container ports by name.
fn container_ports(container: &Value) -> BTreeMap<String, u16> {
    seq(&container["ports"])
        .iter()
        .map(|p| {
            (
                st(&p["name"]).expect("a named port").to_owned(),
                p["containerPort"]
                    .as_u64()
                    .and_then(|n| u16::try_from(n).ok())
                    .expect("a port"),
            )
        })
        .collect()
}

fn container_mounts(container: &Value) -> Vec<Mount> {
    seq(&container["volumeMounts"])
        .iter()
        .map(|m| {
            assert!(m["subPath"].is_null(), "subPath mounts do not see Secret updates");
            Mount {
                at: st(&m["mountPath"]).expect("mountPath").to_owned(),
                volume: st(&m["name"]).expect("a volume name").to_owned(),
            }
        })
        .collect()
}

fn k8s_stack(k8s: &K8s) -> Stack {
    let mut volumes = BTreeMap::new();
    let mut services = Vec::new();
    let mut names = BTreeMap::new();
    for binary in SERVICES {
        let d = k8s.deployment_of(binary);
        let name = st(&d["metadata"]["name"]).expect("a name").to_owned();
        let pod = &d["spec"]["template"]["spec"];
        let fs_group = !pod["securityContext"]["fsGroup"].is_null();
        for v in seq(&pod["volumes"]) {
            let vname = format!("{name}/{}", st(&v["name"]).expect("a volume name"));
            let backing = if !v["secret"].is_null() {
                let s = &v["secret"];
                let mode = s["defaultMode"]
                    .as_u64()
                    .and_then(|m| u32::try_from(m).ok())
                    .unwrap_or(0o644);
                // The kubelet makes a Secret volume's files readable by the
                // pod's fsGroup.
                let mode = if fs_group { mode | 0o440 } else { mode };
                let items = (!s["items"].is_null()).then(|| {
                    seq(&s["items"])
                        .iter()
                        .map(|i| {
                            (
                                st(&i["key"]).expect("key").to_owned(),
                                st(&i["path"]).expect("path").to_owned(),
                            )
                        })
                        .collect()
                });
                Backing::Secret {
                    secret: st(&s["secretName"]).expect("secretName").to_owned(),
                    items,
                    mode,
                }
            } else if !v["emptyDir"].is_null() || !v["persistentVolumeClaim"].is_null() {
                if let Some(claim) = st(&v["persistentVolumeClaim"]["claimName"]) {
                    k8s.named("PersistentVolumeClaim", claim);
                }
                Backing::Empty
            } else {
                panic!("{name}: volume kind not modelled: {v:?}")
            };
            volumes.insert(vname, backing);
        }
        let prefix = |mounts: Vec<Mount>| {
            mounts
                .into_iter()
                .map(|m| Mount {
                    volume: format!("{name}/{}", m.volume),
                    ..m
                })
                .collect::<Vec<_>>()
        };
        let c = main_container(d);
        let mut env = Vec::new();
        for from in seq(&c["envFrom"]) {
            let cm = st(&from["configMapRef"]["name"]).expect("envFrom takes ConfigMaps here");
            env.extend(string_map(&k8s.named("ConfigMap", cm)["data"]));
        }
        for e in seq(&c["env"]) {
            let key = st(&e["name"]).expect("an env name").to_owned();
            let value = st(&e["value"]).unwrap_or_else(|| panic!("{key}: only plain values are modelled"));
            env.retain(|(k, _)| *k != key);
            env.push((key, value.to_owned()));
        }
        let probe = |p: &Value| {
            let cmd = strings(&p["exec"]["command"]);
            assert_eq!(
                cmd.first().map(String::as_str),
                Some(PROBE),
                "{name}: an exec probe"
            );
            cmd[1..].to_vec()
        };
        let readiness = probe(&c["readinessProbe"]);
        assert_eq!(readiness, probe(&c["livenessProbe"]), "{name}: one health check");
        let init = seq(&pod["initContainers"])
            .iter()
            .map(|i| (strings(&i["command"]), prefix(container_mounts(i))))
            .collect();
        services.push(Launch {
            source: format!("deploy/k8s Deployment {name}"),
            binary: binary.to_owned(),
            args: strings(&c["args"]),
            env,
            mounts: prefix(container_mounts(c)),
            init,
            probe: Some(readiness),
        });
    }
    // Service names (and their namespace forms) → the container port behind.
    for svc in k8s.of_kind("Service") {
        let sname = st(&svc["metadata"]["name"]).expect("a name");
        let ns = st(&svc["metadata"]["namespace"]).expect("a namespace");
        let selected: Vec<&Value> = k8s
            .deployments()
            .into_iter()
            .filter(|d| {
                selects(
                    &svc["spec"]["selector"].clone().into_match_labels(),
                    &pod_labels(d),
                )
            })
            .collect();
        assert_eq!(selected.len(), 1, "Service {sname} selects one Deployment");
        let c = main_container(selected[0]);
        let binary = binary_of_image(&c["image"]);
        let ports = container_ports(c);
        for p in seq(&svc["spec"]["ports"]) {
            let port = p["port"]
                .as_u64()
                .and_then(|n| u16::try_from(n).ok())
                .expect("a port");
            let target = match &p["targetPort"] {
                Value::String(n) => *ports
                    .get(n)
                    .unwrap_or_else(|| panic!("Service {sname}: targetPort {n} is no container port")),
                Value::Number(n) => n.as_u64().and_then(|n| u16::try_from(n).ok()).expect("a port"),
                _ => port,
            };
            assert!(
                ports.values().any(|p| *p == target),
                "Service {sname}: port {target} is no container port"
            );
            for host in [
                sname.to_owned(),
                format!("{sname}.{ns}"),
                format!("{sname}.{ns}.svc"),
                format!("{sname}.{ns}.svc.cluster.local"),
            ] {
                names.insert((host, port), (binary.clone(), target));
            }
        }
    }
    Stack {
        name: "kubernetes",
        volumes,
        services,
        names,
        own_hosts: true,
    }
}

trait IntoMatchLabels {
    fn into_match_labels(self) -> Value;
}

impl IntoMatchLabels for Value {
    /// A Service's selector is a bare label map; as `{matchLabels: ...}`.
    fn into_match_labels(self) -> Value {
        let mut m = serde_yaml_ng::Mapping::new();
        m.insert(Value::String("matchLabels".into()), self);
        Value::Mapping(m)
    }
}

/// The generated Secrets: name → key → text.
fn generated_secrets(dir: &Path) -> BTreeMap<String, BTreeMap<String, String>> {
    yaml_docs(&dir.join("k8s-secrets.yaml"))
        .into_iter()
        .map(|d| {
            assert_eq!(st(&d["kind"]), Some("Secret"));
            (
                st(&d["metadata"]["name"]).expect("a name").to_owned(),
                string_map(&d["stringData"]),
            )
        })
        .collect()
}

// ---------------------------------------------------------------------------
// Compose

/// Compose's variable interpolation: `${VAR}`, `${VAR:-default}`,
/// `${VAR:?error}`, `$$`.
fn interpolate(text: &str, vars: &BTreeMap<String, String>) -> anyhow::Result<String> {
    let mut out = String::new();
    let mut rest = text;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        rest = &rest[i + 1..];
        if let Some(r) = rest.strip_prefix('$') {
            out.push('$');
            rest = r;
            continue;
        }
        let r = rest
            .strip_prefix('{')
            .with_context(|| format!("only ${{VAR}} forms are used: {text}"))?;
        let end = r.find('}').with_context(|| format!("unclosed ${{ in {text}"))?;
        let expr = &r[..end];
        rest = &r[end + 1..];
        let value = if let Some((name, msg)) = expr.split_once(":?") {
            vars.get(name)
                .filter(|v| !v.is_empty())
                .with_context(|| format!("{name} is required: {msg}"))?
                .clone()
        } else if let Some((name, default)) = expr.split_once(":-") {
            vars.get(name)
                .filter(|v| !v.is_empty())
                .cloned()
                .unwrap_or_else(|| default.to_owned())
        } else {
            vars.get(expr).cloned().unwrap_or_default()
        };
        out.push_str(&value);
    }
    out.push_str(rest);
    Ok(out)
}

fn interpolate_value(v: &Value, vars: &BTreeMap<String, String>) -> anyhow::Result<Value> {
    Ok(match v {
        Value::String(s) => Value::String(interpolate(s, vars)?),
        Value::Sequence(items) => Value::Sequence(
            items
                .iter()
                .map(|i| interpolate_value(i, vars))
                .collect::<anyhow::Result<_>>()?,
        ),
        Value::Mapping(m) => {
            let mut out = serde_yaml_ng::Mapping::new();
            for (k, v) in m {
                out.insert(k.clone(), interpolate_value(v, vars)?);
            }
            Value::Mapping(out)
        }
        other => other.clone(),
    })
}

/// The compose file with `vars` substituted (as `--env-file` would).
fn compose(vars: &BTreeMap<String, String>) -> anyhow::Result<Value> {
    interpolate_value(&yaml(&deploy("compose.yaml")), vars)
}

/// Placeholder values for checks that do not start anything.
fn placeholder_vars() -> BTreeMap<String, String> {
    [
        ("PROVISIONING_SECRETS", "/secrets"),
        ("PROVISIONING_UID", "1000"),
        ("PROVISIONING_GID", "1000"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect()
}

/// The compose services that run one of ours: binary → compose name.
fn compose_services(c: &Value) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for (name, svc) in c["services"].as_mapping().expect("services") {
        if let Some(target) = st(&svc["build"]["target"]) {
            out.insert(target.to_owned(), st(name).expect("a name").to_owned());
        }
    }
    out
}

fn compose_stack(c: &Value, secrets_dir: &str) -> Stack {
    let mut volumes = BTreeMap::new();
    let mut services = Vec::new();
    let mut names = BTreeMap::new();
    for (binary, name) in compose_services(c) {
        let svc = &c["services"][name.as_str()];
        let mut mounts = Vec::new();
        for (i, v) in strings(&svc["volumes"]).iter().enumerate() {
            let parts: Vec<&str> = v.split(':').collect();
            assert!(
                parts.len() >= 2 && parts.len() <= 3,
                "{name}: a bind mount SRC:DST[:ro]: {v}"
            );
            let rel = parts[0]
                .strip_prefix(secrets_dir)
                .and_then(|r| r.strip_prefix('/'))
                .unwrap_or_else(|| panic!("{name}: {v} mounts something gen-secrets.sh did not make"));
            let id = format!("{name}/bind{i}");
            volumes.insert(id.clone(), Backing::Secrets(rel.to_owned()));
            mounts.push(Mount {
                at: parts[1].to_owned(),
                volume: id,
            });
        }
        for (i, t) in strings(&svc["tmpfs"]).iter().enumerate() {
            let id = format!("{name}/tmpfs{i}");
            volumes.insert(id.clone(), Backing::Empty);
            mounts.push(Mount {
                at: t.clone(),
                volume: id,
            });
        }
        let test = strings(&svc["healthcheck"]["test"]);
        assert_eq!(
            test.get(..2),
            Some(&["CMD".to_owned(), PROBE.to_owned()][..]),
            "{name}: the healthcheck runs {PROBE}"
        );
        let launch = Launch {
            source: format!("deploy/compose.yaml service {name}"),
            binary: binary.clone(),
            args: strings(&svc["command"]),
            env: string_map(&svc["environment"]).into_iter().collect(),
            mounts,
            init: Vec::new(),
            probe: Some(test[2..].to_vec()),
        };
        for port in [launch.grpc_port(), launch.metrics_port()] {
            names.insert((name.clone(), port), (binary.clone(), port));
        }
        services.push(launch);
    }
    services.sort_by_key(|l| SERVICES.iter().position(|s| *s == l.binary));
    Stack {
        name: "compose",
        volumes,
        services,
        names,
        own_hosts: true,
    }
}

// ---------------------------------------------------------------------------
// systemd

/// `[Service]` of a unit file: key → values (in order; continuation lines
/// joined).
fn unit_service_section(path: &Path) -> BTreeMap<String, Vec<String>> {
    let text = read(path);
    let mut joined: Vec<String> = Vec::new();
    let mut cont = false;
    for line in text.lines() {
        let trimmed = line.trim();
        if cont {
            let last = joined.last_mut().expect("a line to continue");
            last.push(' ');
            last.push_str(trimmed.trim_end_matches('\\').trim());
        } else {
            joined.push(trimmed.trim_end_matches('\\').trim().to_owned());
        }
        cont = trimmed.ends_with('\\');
    }
    let mut section = String::new();
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for line in joined {
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        if line.starts_with('[') {
            section = line;
            continue;
        }
        if section == "[Service]" {
            let (k, v) = line
                .split_once('=')
                .unwrap_or_else(|| panic!("{}: {line}", path.display()));
            out.entry(k.to_owned()).or_default().push(v.to_owned());
        }
    }
    out
}

fn unit_files() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(deploy("systemd"))
        .expect("deploy/systemd")
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "service"))
        .collect();
    files.sort();
    files
}

fn systemd_stack() -> Stack {
    let mut volumes = BTreeMap::new();
    volumes.insert("etc".to_owned(), Backing::Secrets(String::new()));
    let mut services = Vec::new();
    let mut names = BTreeMap::new();
    for path in unit_files() {
        let unit = unit_service_section(&path);
        let file = path
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned();
        let exec = unit.get("ExecStart").and_then(|v| v.first()).expect("ExecStart");
        let mut words = exec.split_whitespace().map(str::to_owned);
        let program = words.next().expect("a program");
        let binary = program
            .strip_prefix("/usr/local/bin/")
            .unwrap_or_else(|| panic!("{file}: runs {program}, not one in /usr/local/bin"))
            .to_owned();
        let mut env = Vec::new();
        for assignment in unit.get("Environment").into_iter().flatten() {
            for kv in assignment.split_whitespace() {
                let (k, v) = kv.split_once('=').unwrap_or_else(|| panic!("{file}: {kv}"));
                env.push((k.to_owned(), v.to_owned()));
            }
        }
        let mut mounts = vec![Mount {
            at: "/etc/provisioning".into(),
            volume: "etc".into(),
        }];
        for dir in unit
            .get("StateDirectory")
            .into_iter()
            .flatten()
            .flat_map(|d| d.split_whitespace())
        {
            let id = format!("{file}/{dir}");
            volumes.insert(id.clone(), Backing::Empty);
            mounts.push(Mount {
                at: format!("/var/lib/{dir}"),
                volume: id,
            });
        }
        let launch = Launch {
            source: format!("deploy/systemd/{file}"),
            binary: binary.clone(),
            args: words.collect(),
            env,
            mounts,
            init: Vec::new(),
            probe: None,
        };
        for port in [launch.grpc_port(), launch.metrics_port()] {
            for host in ["localhost", "127.0.0.1"] {
                names.insert((host.to_owned(), port), (binary.clone(), port));
            }
        }
        services.push(launch);
    }
    services.sort_by_key(|l| SERVICES.iter().position(|s| *s == l.binary));
    Stack {
        name: "systemd",
        volumes,
        services,
        names,
        own_hosts: false,
    }
}

// ---------------------------------------------------------------------------
// The Dockerfile

#[derive(Debug, Default)]
struct Stage {
    from: String,
    entrypoint: Vec<String>,
    expose: BTreeSet<u16>,
    copied: Vec<String>,
    user: Option<String>,
}

fn dockerfile() -> BTreeMap<String, Stage> {
    let text = read(&deploy("docker/Dockerfile"));
    let mut lines: Vec<String> = Vec::new();
    let mut cont = false;
    for line in text.lines() {
        let t = line.trim();
        if t.starts_with('#') || (t.is_empty() && !cont) {
            continue;
        }
        if cont {
            let last = lines.last_mut().expect("a line to continue");
            last.push(' ');
            last.push_str(t.trim_end_matches('\\'));
        } else {
            lines.push(t.trim_end_matches('\\').to_owned());
        }
        cont = t.ends_with('\\');
    }
    let mut stages: BTreeMap<String, Stage> = BTreeMap::new();
    let mut current = String::new();
    for line in lines {
        let (instr, rest) = line.split_once(' ').unwrap_or((&line, ""));
        match instr {
            "FROM" => {
                let words: Vec<&str> = rest.split_whitespace().collect();
                assert_eq!(words.len(), 3, "FROM image AS name: {line}");
                current = words[2].to_owned();
                stages.insert(
                    current.clone(),
                    Stage {
                        from: words[0].to_owned(),
                        ..Stage::default()
                    },
                );
            }
            "ENTRYPOINT" => {
                let v: Value = serde_yaml_ng::from_str(rest).expect("ENTRYPOINT in exec form");
                stages.get_mut(&current).expect("a stage").entrypoint = strings(&v);
            }
            "EXPOSE" => {
                let stage = stages.get_mut(&current).expect("a stage");
                stage
                    .expose
                    .extend(rest.split_whitespace().map(|p| p.parse::<u16>().expect("a port")));
            }
            "COPY" => {
                let stage = stages.get_mut(&current).expect("a stage");
                stage.copied.extend(
                    rest.split_whitespace()
                        .filter(|w| !w.starts_with("--"))
                        .map(str::to_owned),
                );
            }
            "USER" => {
                stages.get_mut(&current).expect("a stage").user = Some(rest.trim().to_owned());
            }
            _ => {}
        }
    }
    stages
}

/// What a stage and the stages it builds on copy in (file names).
fn copied_into(stages: &BTreeMap<String, Stage>, target: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut at = Some(target.to_owned());
    while let Some(name) = at {
        let Some(stage) = stages.get(&name) else { break };
        out.extend(
            stage
                .copied
                .iter()
                .map(|p| p.rsplit('/').find(|s| !s.is_empty()).unwrap_or(p).to_owned()),
        );
        at = Some(stage.from.clone());
    }
    out
}

fn user_of(stages: &BTreeMap<String, Stage>, target: &str) -> Option<String> {
    let mut at = Some(target.to_owned());
    while let Some(name) = at {
        let stage = stages.get(&name)?;
        if let Some(u) = &stage.user {
            return Some(u.clone());
        }
        at = Some(stage.from.clone());
    }
    None
}

// ---------------------------------------------------------------------------
// The binaries

struct Help {
    flags: BTreeSet<String>,
    env: BTreeSet<String>,
    /// The executable's bytes, to find variables read by name.
    exe: Vec<u8>,
}

fn help(binary: &str) -> Help {
    let path = procs::bin_path(binary).expect("the workspace binaries are built");
    let out = Command::new(&path)
        .arg("--help")
        .output()
        .expect("running --help");
    assert!(out.status.success(), "{binary} --help failed");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let mut flags = BTreeSet::new();
    let mut env = BTreeSet::new();
    for word in text.split(|c: char| c.is_whitespace() || c == ',' || c == '[' || c == ']') {
        if let Some(f) = word.strip_prefix("--") {
            let f: String = f
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                .collect();
            if !f.is_empty() {
                flags.insert(f);
            }
        }
    }
    for piece in text.split("[env: ").skip(1) {
        if let Some((name, _)) = piece.split_once('=') {
            env.insert(name.to_owned());
        }
    }
    assert!(
        flags.contains("listen") && env.contains("PROVISIONING_LISTEN"),
        "{binary}: help parsed"
    );
    Help {
        flags,
        env,
        exe: std::fs::read(&path).expect("reading the executable"),
    }
}

/// The long flags named in `args` (without `--`).
fn long_flags(args: &[String]) -> Vec<String> {
    args.iter()
        .filter_map(|a| a.strip_prefix("--"))
        .map(|f| f.split('=').next().unwrap_or(f).to_owned())
        .collect()
}

/// `-name[=value]` flags of a probe command.
fn probe_flags(args: &[String]) -> BTreeMap<String, String> {
    args.iter()
        .map(|a| {
            let a = a
                .strip_prefix('-')
                .unwrap_or_else(|| panic!("probe arguments are -flag[=value]: {a}"));
            let (k, v) = a.split_once('=').unwrap_or((a, ""));
            (k.to_owned(), v.to_owned())
        })
        .collect()
}

fn all_stacks_without_secrets() -> Vec<Stack> {
    let c = compose(&placeholder_vars()).expect("compose interpolates");
    vec![
        k8s_stack(&K8s::load()),
        compose_stack(&c, "/secrets"),
        systemd_stack(),
    ]
}

#[test]
fn every_flag_and_variable_in_the_manifests_exists_in_the_binaries() {
    let helps: BTreeMap<&str, Help> = SERVICES.iter().map(|b| (*b, help(b))).collect();
    let readme = read(&repo().join("README.md"));
    let mut checked = 0;
    for stack in all_stacks_without_secrets() {
        assert_eq!(
            stack
                .services
                .iter()
                .map(|l| l.binary.as_str())
                .collect::<Vec<_>>(),
            SERVICES,
            "{}: the three services",
            stack.name
        );
        for l in &stack.services {
            let h = &helps[l.binary.as_str()];
            for f in long_flags(&l.args) {
                assert!(
                    h.flags.contains(&f),
                    "{}: {} has no flag --{f}",
                    l.source,
                    l.binary
                );
                checked += 1;
            }
            for (k, _) in &l.env {
                // A variable --help does not list must be one the README
                // documents (the OpenTelemetry SDK's, the log filter's) and
                // one the executable reads by name.
                let known = h.env.contains(k)
                    || (readme.contains(&format!("`{k}`"))
                        && h.exe.windows(k.len()).any(|w| w == k.as_bytes()));
                assert!(known, "{}: {} neither takes nor reads {k}", l.source, l.binary);
                checked += 1;
            }
            // Every flag is given once (clap refuses repeats of most).
            let mut seen = BTreeSet::new();
            for f in long_flags(&l.args) {
                assert!(seen.insert(f.clone()), "{}: --{f} given twice", l.source);
            }
            if let Some(p) = &l.probe {
                for f in probe_flags(p).keys() {
                    assert!(
                        PROBE_FLAGS.contains(&f.as_str()),
                        "{}: {PROBE} has no -{f}",
                        l.source
                    );
                }
            }
        }
    }
    // A name that is nowhere is caught (the check can fail).
    let h = &helps["driver-svc"];
    assert!(!h.flags.contains("no-such-flag"));
    assert!(!h.exe.windows(22).any(|w| w == b"PROVISIONING_NO_SUCH_V"));
    assert!(checked > 60, "checked {checked} names");
}
/// The gRPC and metrics ports of each service, as the Kubernetes manifests
/// give them.
fn kube_ports(kube: &Stack) -> (BTreeMap<String, u16>, BTreeMap<String, u16>) {
    let grpc = kube
        .services
        .iter()
        .map(|l| (l.binary.clone(), l.grpc_port()))
        .collect();
    let metrics = kube
        .services
        .iter()
        .map(|l| (l.binary.clone(), l.metrics_port()))
        .collect();
    (grpc, metrics)
}

#[test]
fn kubernetes_ports_services_probes_and_pods_agree() {
    let k8s = K8s::load();
    let stacks = all_stacks_without_secrets();
    let kube = &stacks[0];

    // Kubernetes: --listen and --metrics-listen are the named container
    // ports, the probes check the gRPC port on loopback.
    let mut grpc = BTreeMap::new();
    let mut metrics = BTreeMap::new();
    for l in &kube.services {
        let d = k8s.deployment_of(&l.binary);
        let c = main_container(d);
        let ports = container_ports(c);
        assert_eq!(ports.get("grpc"), Some(&l.grpc_port()), "{}: grpc port", l.source);
        assert_eq!(
            ports.get("metrics"),
            Some(&l.metrics_port()),
            "{}: metrics port",
            l.source
        );
        grpc.insert(l.binary.clone(), l.grpc_port());
        metrics.insert(l.binary.clone(), l.metrics_port());
        let listen = l.flag("--listen").expect("--listen");
        assert!(
            listen.starts_with("0.0.0.0:"),
            "{}: a pod listens on its IP",
            l.source
        );
        // Security and resources.
        let pod = &d["spec"]["template"]["spec"];
        let sc = &pod["securityContext"];
        assert_eq!(sc["runAsNonRoot"].as_bool(), Some(true), "{}", l.source);
        assert_eq!(sc["seccompProfile"]["type"].as_str(), Some("RuntimeDefault"));
        assert_eq!(pod["automountServiceAccountToken"].as_bool(), Some(false));
        let containers: Vec<&Value> = seq(&pod["containers"])
            .iter()
            .chain(seq(&pod["initContainers"]))
            .collect();
        for c in containers {
            let csc = &c["securityContext"];
            assert_eq!(
                csc["allowPrivilegeEscalation"].as_bool(),
                Some(false),
                "{}",
                l.source
            );
            assert_eq!(
                csc["readOnlyRootFilesystem"].as_bool(),
                Some(true),
                "{}",
                l.source
            );
            assert_eq!(strings(&csc["capabilities"]["drop"]), ["ALL"], "{}", l.source);
            assert!(
                !c["resources"]["requests"]["cpu"].is_null()
                    && !c["resources"]["requests"]["memory"].is_null(),
                "{}: resource requests",
                l.source
            );
        }
        // The TLS Secret is mounted where the flags look.
        for flag in ["--tls-cert", "--tls-key", "--tls-ca"] {
            let path = l.flag(flag).expect("TLS flags");
            assert!(
                l.mounts.iter().any(|m| path.starts_with(&format!("{}/", m.at))),
                "{}: {flag} {path} is on no mount",
                l.source
            );
        }
    }
    for l in stacks.iter().flat_map(|s| &s.services) {
        if let Some(p) = &l.probe {
            let flags = probe_flags(p);
            let (_, host, port) = parse_addr(&flags["addr"]).expect("-addr=host:port");
            assert_eq!(
                host, "127.0.0.1",
                "{}: the probe runs beside the service",
                l.source
            );
            assert_eq!(
                port,
                l.grpc_port(),
                "{}: the probe checks the gRPC port",
                l.source
            );
            assert!(flags.contains_key("tls"), "{}: the probe speaks TLS", l.source);
            for (probe_flag, flag) in [
                ("tls-ca-cert", "--tls-ca"),
                ("tls-client-cert", "--tls-cert"),
                ("tls-client-key", "--tls-key"),
            ] {
                assert_eq!(
                    Some(flags[probe_flag].as_str()),
                    l.flag(flag),
                    "{}: the probe presents the service's own certificate",
                    l.source
                );
            }
        }
    }

    // Services: one per Deployment, exposing exactly its container ports.
    for d in k8s.deployments() {
        let labels = pod_labels(d);
        let ports: BTreeSet<u16> = container_ports(main_container(d)).into_values().collect();
        let services: Vec<&Value> = k8s
            .of_kind("Service")
            .filter(|s| selects(&s["spec"]["selector"].clone().into_match_labels(), &labels))
            .collect();
        assert_eq!(services.len(), 1, "{:?}: one Service", d["metadata"]["name"]);
        let exposed: BTreeSet<u16> = seq(&services[0]["spec"]["ports"])
            .iter()
            .map(|p| {
                p["port"]
                    .as_u64()
                    .and_then(|n| u16::try_from(n).ok())
                    .expect("a port")
            })
            .collect();
        assert_eq!(exposed, ports, "{:?}: the Service's ports", d["metadata"]["name"]);
    }

    // The driver dials the Services of the decider and the executor.
    let driver = kube.service("driver-svc");
    for (flag, binary) in [("--decider", "decider-svc"), ("--executor", "executor-svc")] {
        let (_, host, port) = parse_addr(driver.flag(flag).expect(flag)).expect("host:port");
        assert_eq!(
            kube.names.get(&(host.clone(), port)),
            Some(&(binary.to_owned(), grpc[binary])),
            "{flag} {host}:{port}"
        );
    }

    // The decider (more than one replica) has a PodDisruptionBudget.
    let decider = k8s.deployment_of("decider-svc");
    assert!(decider["spec"]["replicas"].as_u64() >= Some(2));
    let pdb = k8s.named("PodDisruptionBudget", "decider");
    assert!(selects(&pdb["spec"]["selector"], &pod_labels(decider)));
    assert_eq!(pdb["spec"]["minAvailable"].as_u64(), Some(1));
    for binary in ["executor-svc", "driver-svc"] {
        let d = k8s.deployment_of(binary);
        assert_eq!(d["spec"]["replicas"].as_u64(), Some(1), "{binary}: one writer");
        assert_eq!(
            st(&d["spec"]["strategy"]["type"]),
            Some("Recreate"),
            "{binary}: never two"
        );
    }
}

#[test]
fn network_policies_let_only_the_driver_reach_the_decider_and_the_executor() {
    let k8s = K8s::load();
    let stacks = all_stacks_without_secrets();
    let (grpc, metrics) = kube_ports(&stacks[0]);
    // NetworkPolicies: who may reach each container port.
    #[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
    enum Peer {
        Anyone,
        Pods(String),
        Labelled(BTreeMap<String, String>),
    }
    let policies: Vec<&Value> = k8s.of_kind("NetworkPolicy").collect();
    assert!(
        policies.iter().any(|p| {
            p["spec"]["podSelector"]
                .as_mapping()
                .is_some_and(|m| m.is_empty())
                && strings(&p["spec"]["policyTypes"]) == ["Ingress"]
                && p["spec"]["ingress"].is_null()
        }),
        "a default-deny ingress policy"
    );
    let deployment_names: BTreeMap<String, BTreeMap<String, String>> = k8s
        .deployments()
        .into_iter()
        .map(|d| {
            (
                st(&d["metadata"]["name"]).expect("a name").to_owned(),
                pod_labels(d),
            )
        })
        .collect();
    let mut reach: BTreeMap<(String, u16), BTreeSet<Peer>> = BTreeMap::new();
    for d in k8s.deployments() {
        let name = st(&d["metadata"]["name"]).expect("a name").to_owned();
        let labels = pod_labels(d);
        let ports = container_ports(main_container(d));
        for p in &policies {
            if !selects(&p["spec"]["podSelector"], &labels) {
                continue;
            }
            assert!(strings(&p["spec"]["policyTypes"]).contains(&"Ingress".to_owned()));
            for rule in seq(&p["spec"]["ingress"]) {
                let rule_ports: Vec<u16> = seq(&rule["ports"])
                    .iter()
                    .map(|rp| {
                        let n = match &rp["port"] {
                            Value::String(named) => *ports.get(named).expect("a named container port"),
                            v => v.as_u64().and_then(|n| u16::try_from(n).ok()).expect("a port"),
                        };
                        assert!(
                            ports.values().any(|p| *p == n),
                            "policy {:?}: {name} has no port {n}",
                            p["metadata"]["name"]
                        );
                        n
                    })
                    .collect();
                let covered: Vec<u16> = if rule_ports.is_empty() {
                    ports.values().copied().collect()
                } else {
                    rule_ports
                };
                let peers: Vec<Peer> = if seq(&rule["from"]).is_empty() {
                    vec![Peer::Anyone]
                } else {
                    seq(&rule["from"])
                        .iter()
                        .flat_map(|f| {
                            if f["namespaceSelector"].is_null() && !f["podSelector"].is_null() {
                                deployment_names
                                    .iter()
                                    .filter(|(_, l)| selects(&f["podSelector"], l))
                                    .map(|(n, _)| Peer::Pods(n.clone()))
                                    .collect::<Vec<_>>()
                            } else {
                                let l = string_map(&f["podSelector"]["matchLabels"]);
                                assert!(!l.is_empty(), "a peer in any namespace is narrowed by labels");
                                vec![Peer::Labelled(l)]
                            }
                        })
                        .collect()
                };
                for port in covered {
                    reach
                        .entry((name.clone(), port))
                        .or_default()
                        .extend(peers.iter().cloned());
                }
            }
        }
    }
    let driver_pods = BTreeSet::from([Peer::Pods("driver".to_owned())]);
    for (deployment, binary) in [("decider", "decider-svc"), ("executor", "executor-svc")] {
        assert_eq!(
            reach.get(&(deployment.to_owned(), grpc[binary])),
            Some(&driver_pods),
            "only the driver reaches the {deployment}'s gRPC port"
        );
    }
    assert_eq!(
        reach.get(&("driver".to_owned(), grpc["driver-svc"])),
        Some(&BTreeSet::from([Peer::Anyone])),
        "the driver's API is open"
    );
    for (binary, port) in &metrics {
        let deployment = st(&k8s.deployment_of(binary)["metadata"]["name"]).expect("a name");
        let peers = reach
            .get(&(deployment.to_owned(), *port))
            .expect("metrics are scraped");
        assert!(
            peers.iter().all(|p| matches!(p, Peer::Labelled(_))),
            "{deployment}'s metrics: scrapers only, {peers:?}"
        );
    }
}

#[test]
fn compose_and_its_collector_agree_with_the_kubernetes_ports() {
    let stacks = all_stacks_without_secrets();
    let (grpc, metrics) = kube_ports(&stacks[0]);
    // Compose: the same ports; only the driver's is published.
    let c = compose(&placeholder_vars()).expect("compose");
    let names = compose_services(&c);
    let cstack = &stacks[1];
    for l in &cstack.services {
        assert_eq!(
            l.grpc_port(),
            grpc[&l.binary],
            "{}: grpc port as in k8s",
            l.source
        );
        assert_eq!(
            l.metrics_port(),
            metrics[&l.binary],
            "{}: metrics port as in k8s",
            l.source
        );
        let svc = &c["services"][names[&l.binary].as_str()];
        let published = strings(&svc["ports"]);
        if l.binary == "driver-svc" {
            assert_eq!(published, [format!("127.0.0.1:{0}:{0}", grpc["driver-svc"])]);
        } else {
            assert!(published.is_empty(), "{}: not published", l.source);
        }
        assert_eq!(st(&svc["build"]["dockerfile"]), Some("deploy/docker/Dockerfile"));
        assert_eq!(st(&svc["build"]["context"]), Some(".."));
        assert_eq!(binary_of_image(&svc["image"]), l.binary, "{}: image", l.source);
    }
    let cdriver = cstack.service("driver-svc");
    for (flag, binary) in [("--decider", "decider-svc"), ("--executor", "executor-svc")] {
        let (_, host, port) = parse_addr(cdriver.flag(flag).expect(flag)).expect("host:port");
        assert_eq!(
            (host, port),
            (names[binary].clone(), grpc[binary]),
            "compose {flag}"
        );
    }
    // The collector: receives where the services send, scrapes where they
    // serve metrics, sends to Jaeger.
    let overlay = yaml(&deploy("otel-collector.compose.yaml"));
    let collector = &c["services"]["otel-collector"];
    let otlp = st(&overlay["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]).expect("an OTLP endpoint");
    let otlp_port = parse_addr(otlp).expect("host:port").2;
    for l in &cstack.services {
        let endpoint = l
            .env
            .iter()
            .find(|(k, _)| k == "OTEL_EXPORTER_OTLP_ENDPOINT")
            .map(|(_, v)| v.as_str())
            .expect("traces are exported");
        assert_eq!(
            endpoint,
            format!("http://otel-collector:{otlp_port}"),
            "{}",
            l.source
        );
    }
    let mut targets = BTreeSet::new();
    for job in seq(&overlay["receivers"]["prometheus"]["config"]["scrape_configs"]) {
        for sc in seq(&job["static_configs"]) {
            targets.extend(strings(&sc["targets"]));
        }
    }
    let want: BTreeSet<String> = cstack
        .services
        .iter()
        .map(|l| format!("{}:{}", names[&l.binary], l.metrics_port()))
        .collect();
    assert_eq!(targets, want, "the collector scrapes the services");
    assert_eq!(
        strings(&collector["command"]),
        [
            "--config=/etc/otelcol/config.yaml",
            "--config=/etc/otelcol/compose.yaml"
        ]
    );
    assert_eq!(
        strings(&collector["volumes"]),
        [
            "./otel-collector.yaml:/etc/otelcol/config.yaml:ro",
            "./otel-collector.compose.yaml:/etc/otelcol/compose.yaml:ro"
        ]
    );
    assert_eq!(
        string_map(&collector["environment"])["TRACE_BACKEND"],
        "jaeger:4317"
    );
    assert!(!c["services"]["jaeger"].is_null() && !c["services"]["etcd"].is_null());
    // etcd only on request: nothing in the stack uses it by default.
    assert_eq!(strings(&c["services"]["etcd"]["profiles"]), ["etcd"]);
    // The overlay only overrides what the base configuration defines: the
    // receivers' addresses, and the metrics pipeline's exporters (Jaeger
    // takes traces only: metrics are logged, and Prometheus scrapes them).
    let base = yaml(&deploy("otel-collector.yaml"));
    for r in overlay["receivers"].as_mapping().expect("receivers").keys() {
        assert!(
            !base["receivers"][st(r).expect("a name")].is_null(),
            "{r:?} is a base receiver"
        );
    }
    assert_eq!(
        overlay.as_mapping().map(|m| m.len()),
        Some(2),
        "the overlay changes receivers and one pipeline"
    );
    assert_eq!(
        overlay["service"]["pipelines"].as_mapping().map(|m| m.len()),
        Some(1)
    );
    assert_eq!(
        strings(&overlay["service"]["pipelines"]["metrics"]["exporters"]),
        ["debug"]
    );
    assert!(!base["exporters"]["debug"].is_null());
    // Prometheus scrapes every service where it serves metrics, with the
    // alerting rules, and is reachable on the host's loopback only.
    let prometheus = &c["services"]["prometheus"];
    assert_eq!(
        strings(&prometheus["volumes"]),
        [
            "./prometheus.compose.yml:/etc/prometheus/prometheus.yml:ro",
            "./prometheus-rules.yml:/etc/prometheus/prometheus-rules.yml:ro"
        ]
    );
    assert_eq!(strings(&prometheus["ports"]), ["127.0.0.1:9090:9090"]);
    let config = yaml(&deploy("prometheus.compose.yml"));
    let mut scraped = BTreeSet::new();
    for job in seq(&config["scrape_configs"]) {
        for sc in seq(&job["static_configs"]) {
            scraped.extend(strings(&sc["targets"]));
        }
    }
    assert_eq!(scraped, want, "compose's Prometheus scrapes the services");
    assert_eq!(strings(&config["rule_files"]), ["prometheus-rules.yml"]);
}

#[test]
fn systemd_units_agree_with_the_kubernetes_ports_and_telemetry_env() {
    let stacks = all_stacks_without_secrets();
    let (grpc, _) = kube_ports(&stacks[0]);
    // systemd: the same gRPC ports, loopback for the decider and the
    // executor, and the telemetry addresses of deploy/telemetry.env.
    let telemetry: BTreeMap<String, String> = read(&deploy("telemetry.env"))
        .lines()
        .filter(|l| !l.starts_with('#') && l.contains('='))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    for l in &stacks[2].services {
        assert_eq!(
            l.grpc_port(),
            grpc[&l.binary],
            "{}: grpc port as in k8s",
            l.source
        );
        let key = format!("{}_METRICS", l.binary.trim_end_matches("-svc").to_uppercase());
        assert_eq!(
            l.flag("--metrics-listen"),
            telemetry.get(&key).map(String::as_str),
            "{}",
            l.source
        );
        let endpoint = l
            .env
            .iter()
            .find(|(k, _)| k == "OTEL_EXPORTER_OTLP_ENDPOINT")
            .map(|(_, v)| v.clone());
        assert_eq!(
            endpoint,
            Some(format!("http://{}", telemetry["OTLP_GRPC"])),
            "{}",
            l.source
        );
        if l.binary != "driver-svc" {
            assert!(
                l.flag("--listen").is_some_and(|a| a.starts_with("127.0.0.1:")),
                "{}: loopback only",
                l.source
            );
        }
    }
    let sdriver = stacks[2].service("driver-svc");
    for (flag, binary) in [("--decider", "decider-svc"), ("--executor", "executor-svc")] {
        let (_, host, port) = parse_addr(sdriver.flag(flag).expect(flag)).expect("host:port");
        // Dialled where the unit listens (not `localhost`, which may resolve
        // to ::1 first); deploy/gen-secrets.sh's certificates name 127.0.0.1.
        let listen = stacks[2].service(binary).flag("--listen").expect("--listen");
        let (_, listen_host, _) = parse_addr(listen).expect("host:port");
        assert_eq!(host, listen_host, "systemd {flag}: dials where {binary} listens");
        assert_eq!(host, "127.0.0.1", "systemd {flag}");
        assert_eq!(port, grpc[binary], "systemd {flag}");
    }
}

#[test]
fn the_dockerfile_builds_each_service_as_the_manifests_run_it() {
    let k8s = K8s::load();
    let stacks = all_stacks_without_secrets();
    let (grpc, metrics) = kube_ports(&stacks[0]);
    // The Dockerfile: a target per service running it, exposing its ports,
    // as the non-root user the pods run as, with the probe in the image.
    let stages = dockerfile();
    for binary in SERVICES {
        let stage = stages
            .get(binary)
            .unwrap_or_else(|| panic!("no Dockerfile target {binary}"));
        assert_eq!(stage.entrypoint.last().map(String::as_str), Some(binary));
        assert_eq!(
            stage.entrypoint.first().map(String::as_str),
            Some("/usr/bin/tini")
        );
        assert_eq!(
            stage.expose,
            BTreeSet::from([grpc[binary], metrics[binary]]),
            "{binary}: EXPOSE"
        );
        let files = copied_into(&stages, binary);
        assert!(
            files.contains(binary) && files.contains(PROBE),
            "{binary}: image holds {files:?}"
        );
        let d = k8s.deployment_of(binary);
        let sc = &d["spec"]["template"]["spec"]["securityContext"];
        let user = format!(
            "{}:{}",
            sc["runAsUser"].as_u64().unwrap_or_default(),
            sc["runAsGroup"].as_u64().unwrap_or_default()
        );
        assert_eq!(
            user_of(&stages, binary),
            Some(user),
            "{binary}: the image's user is the pod's"
        );
        for c in seq(&d["spec"]["template"]["spec"]["containers"])
            .iter()
            .chain(seq(&d["spec"]["template"]["spec"]["initContainers"]))
        {
            assert_eq!(
                binary_of_image(&c["image"]),
                binary,
                "{binary}: one image per pod"
            );
        }
    }
    assert!(copied_into(&stages, "executor-svc").contains("node-agent"));
}

// ---------------------------------------------------------------------------
// Starting a stack

/// Writes the secrets the way the deploy README says, with this build's
/// provisionctl.
fn gen_secrets(dir: &Path) -> PathBuf {
    let out = dir.join("secrets");
    let gen_secrets = || {
        Command::new("bash")
            .arg(deploy("gen-secrets.sh"))
            .arg(&out)
            .arg("2")
            .env(
                "PROVISIONCTL",
                procs::bin_path("provisionctl").expect("provisionctl"),
            )
            .output()
            .expect("running gen-secrets.sh")
    };
    let run = gen_secrets();
    assert!(
        run.status.success(),
        "gen-secrets.sh failed: {}",
        String::from_utf8_lossy(&run.stderr)
    );
    // It refuses to overwrite what it wrote.
    assert!(
        !gen_secrets().status.success(),
        "gen-secrets.sh overwrote {}",
        out.display()
    );
    out
}

/// A listener that takes connections and drops them: where an address outside
/// the stack (the trace collector) points.
async fn sink() -> anyhow::Result<SocketAddr> {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = l.local_addr()?;
    tokio::spawn(async move { while l.accept().await.is_ok() {} });
    Ok(addr)
}

/// The stack's volumes made real: volume id → directory or file.
fn materialise(
    stack: &Stack,
    work: &Path,
    secrets: &Path,
    k8s_secrets: &BTreeMap<String, BTreeMap<String, String>>,
) -> anyhow::Result<BTreeMap<String, PathBuf>> {
    use std::os::unix::fs::PermissionsExt as _;
    let mut out = BTreeMap::new();
    for (i, (id, backing)) in stack.volumes.iter().enumerate() {
        let path = match backing {
            Backing::Empty => {
                let p = work.join(format!("vol{i}"));
                std::fs::create_dir_all(&p)?;
                std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o700))?;
                p
            }
            Backing::Secret { secret, items, mode } => {
                let data = k8s_secrets
                    .get(secret)
                    .with_context(|| format!("{id}: gen-secrets.sh makes no Secret {secret}"))?;
                let p = work.join(format!("vol{i}"));
                std::fs::create_dir_all(&p)?;
                let files: Vec<(String, String)> = match items {
                    Some(items) => items.clone(),
                    None => data.keys().map(|k| (k.clone(), k.clone())).collect(),
                };
                for (key, file) in files {
                    let text = data
                        .get(&key)
                        .with_context(|| format!("Secret {secret} has no {key}"))?;
                    let f = p.join(file);
                    std::fs::write(&f, text)?;
                    std::fs::set_permissions(&f, std::fs::Permissions::from_mode(*mode))?;
                }
                p
            }
            Backing::Secrets(rel) => {
                let p = if rel.is_empty() {
                    secrets.to_path_buf()
                } else {
                    secrets.join(rel)
                };
                ensure!(
                    p.exists(),
                    "{id}: {} does not exist (gen-secrets.sh makes no such file)",
                    p.display()
                );
                p
            }
        };
        out.insert(id.clone(), path);
    }
    Ok(out)
}

/// A path a manifest names, on this machine.
fn map_path(path: &str, mounts: &[Mount], volumes: &BTreeMap<String, PathBuf>) -> anyhow::Result<PathBuf> {
    let best = mounts
        .iter()
        .filter(|m| path == m.at || path.starts_with(&format!("{}/", m.at)))
        .max_by_key(|m| m.at.len())
        .with_context(|| format!("{path} is on no volume"))?;
    let base = &volumes[&best.volume];
    let rest = path[best.at.len()..].trim_start_matches('/');
    Ok(if rest.is_empty() {
        base.clone()
    } else {
        base.join(rest)
    })
}

/// The stack's services, running.
struct Running {
    services: BTreeMap<String, Service>,
    /// `(binary, container port)` → where it listens here.
    bound: BTreeMap<(String, u16), SocketAddr>,
    volumes: BTreeMap<String, PathBuf>,
    agents_root: PathBuf,
}

impl Drop for Running {
    fn drop(&mut self) {
        // Node agents outlive their executor by design; a failed test leaves
        // none.
        for (pid, _, _) in procs::live_agent_pids(&self.agents_root) {
            let _ = Command::new("kill").arg("-KILL").arg(pid.to_string()).status();
        }
    }
}

async fn start_stack(stack: &Stack, work: &Path, secrets: &Path) -> anyhow::Result<Running> {
    procs::become_subreaper()?;
    let k8s_secrets = generated_secrets(secrets);
    let volumes = materialise(stack, &work.join("volumes"), secrets, &k8s_secrets)?;
    let elsewhere = sink().await?;
    let mut running = Running {
        services: BTreeMap::new(),
        bound: BTreeMap::new(),
        volumes,
        agents_root: work.join("volumes"),
    };
    for l in &stack.services {
        for (cmd, mounts) in &l.init {
            let args: Vec<String> = cmd
                .iter()
                .map(|a| match a.starts_with('/') {
                    true => map_path(a, mounts, &running.volumes).map(|p| p.display().to_string()),
                    false => Ok(a.clone()),
                })
                .collect::<anyhow::Result<_>>()?;
            let status = Command::new(&args[0]).args(&args[1..]).status()?;
            ensure!(status.success(), "{}: init command {args:?} failed", l.source);
        }
        let rewrite = |v: &str| -> anyhow::Result<String> {
            if v.starts_with('/') {
                if let Some(exe) = v.strip_prefix("/usr/local/bin/") {
                    return Ok(procs::bin_path(exe)?.display().to_string());
                }
                return Ok(map_path(v, &l.mounts, &running.volumes)
                    .with_context(|| l.source.clone())?
                    .display()
                    .to_string());
            }
            let Some((scheme, host, port)) = parse_addr(v) else {
                return Ok(v.to_owned());
            };
            match stack.names.get(&(host.clone(), port)) {
                Some(target) => {
                    let addr = running
                        .bound
                        .get(target)
                        .with_context(|| format!("{}: {v} is not up yet", l.source))?;
                    Ok(format!("{scheme}localhost:{}", addr.port()))
                }
                None => {
                    // A name of this stack on a port it does not serve is a
                    // mistake; any other address is outside the stack.
                    ensure!(
                        !stack.own_hosts || !stack.names.keys().any(|(h, _)| *h == host),
                        "{}: {v}: {host} serves no port {port}",
                        l.source
                    );
                    Ok(format!("{scheme}{elsewhere}"))
                }
            }
        };
        let mut args = Vec::new();
        let mut listen = None;
        let mut it = l.args.iter();
        while let Some(a) = it.next() {
            match a.as_str() {
                "--listen" => {
                    listen = it.next().cloned();
                }
                "--metrics-listen" => {
                    it.next();
                    args.extend(["--metrics-listen".to_owned(), "127.0.0.1:0".to_owned()]);
                }
                flag if flag.starts_with("--") => args.push(flag.to_owned()),
                value => args.push(rewrite(value)?),
            }
        }
        let listen = listen.with_context(|| format!("{}: no --listen", l.source))?;
        let env: Vec<(String, String)> = l
            .env
            .iter()
            .map(|(k, v)| Ok((k.clone(), rewrite(v)?)))
            .collect::<anyhow::Result<_>>()?;
        let svc = Service::start_with_env(&l.binary, work, "127.0.0.1:0", &args, &env)
            .await
            .with_context(|| format!("starting {} as {} says ({args:?})", l.binary, l.source))?;
        running.bound.insert(
            (l.binary.clone(), parse_addr(&listen).expect("host:port").2),
            svc.addr,
        );
        let metrics = svc
            .metrics_addr
            .with_context(|| format!("{}: no metrics address announced", l.source))?;
        running
            .bound
            .insert((l.binary.clone(), l.metrics_port()), metrics);
        running.services.insert(l.binary.clone(), svc);
    }
    Ok(running)
}

/// One gRPC health check with `grpc-health-probe`'s arguments, to the
/// service's address here.
async fn probe(
    probe: &[String],
    l: &Launch,
    running: &Running,
    client_cert: bool,
) -> anyhow::Result<ServingStatus> {
    let flags = probe_flags(probe);
    let file = |name: &str| -> anyhow::Result<Vec<u8>> {
        let path = flags.get(name).with_context(|| format!("no -{name}"))?;
        Ok(std::fs::read(map_path(path, &l.mounts, &running.volumes)?)?)
    };
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(file("tls-ca-cert")?))
        .domain_name(
            flags
                .get("tls-server-name")
                .cloned()
                .unwrap_or_else(|| "localhost".into()),
        );
    if client_cert {
        tls = tls.identity(Identity::from_pem(
            file("tls-client-cert")?,
            file("tls-client-key")?,
        ));
    }
    let addr = running.services[&l.binary].addr;
    let channel = Endpoint::from_shared(format!("https://{addr}"))?
        .tls_config(tls)?
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(5))
        .connect()
        .await?;
    let answer = HealthClient::new(channel)
        .check(HealthCheckRequest {
            service: flags.get("service").cloned().unwrap_or_default(),
        })
        .await?
        .into_inner();
    Ok(ServingStatus::try_from(answer.status)?)
}

fn provisionctl(running: &Running, secrets: &Path, token: bool, args: &[&str]) -> std::process::Output {
    let driver = running.services["driver-svc"].addr;
    let mut cmd = Command::new(procs::bin_path("provisionctl").expect("provisionctl"));
    cmd.arg("--server")
        .arg(format!("localhost:{}", driver.port()))
        .arg("--tls-ca")
        .arg(secrets.join("tls/ca.pem"));
    if token {
        cmd.arg("--token-file").arg(secrets.join("admin.token"));
    }
    cmd.args(args)
        .env_remove("PROVISIONCTL_TOKEN")
        .output()
        .expect("running provisionctl")
}

/// Starts `stack`, checks every service's health probe, converges and deletes
/// a small run through it, and stops it with SIGTERM.
async fn run_stack(stack: Stack, work: &Path, secrets: &Path) {
    let mut running = match start_stack(&stack, work, secrets).await {
        Ok(r) => r,
        Err(e) => {
            dump_logs(work);
            panic!("{}: {e:#}", stack.name);
        }
    };
    let result = exercise(&stack, &mut running, work, secrets).await;
    if let Err(e) = result {
        dump_logs(work);
        panic!("{}: {e:#}", stack.name);
    }
}

fn dump_logs(work: &Path) {
    for name in SERVICES {
        if let Ok(s) = std::fs::read_to_string(work.join(format!("{name}.log"))) {
            let tail: Vec<&str> = s.lines().rev().take(40).collect();
            eprintln!("----- {name} (last lines) -----");
            for l in tail.iter().rev() {
                eprintln!("{l}");
            }
        }
    }
}

async fn exercise(stack: &Stack, running: &mut Running, work: &Path, secrets: &Path) -> anyhow::Result<()> {
    // Each service answers its health probe: the manifest's, or for systemd
    // (no probe) one with the unit's own certificate.
    for l in &stack.services {
        let args = match &l.probe {
            Some(p) => p.clone(),
            None => vec![
                format!("-addr=127.0.0.1:{}", l.grpc_port()),
                "-tls".to_owned(),
                format!("-tls-ca-cert={}", l.flag("--tls-ca").context("--tls-ca")?),
                format!("-tls-client-cert={}", l.flag("--tls-cert").context("--tls-cert")?),
                format!("-tls-client-key={}", l.flag("--tls-key").context("--tls-key")?),
            ],
        };
        let status = probe(&args, l, running, true)
            .await
            .with_context(|| format!("{}: health probe {args:?}", l.source))?;
        ensure!(status == ServingStatus::Serving, "{}: {status:?}", l.source);
        // Without a client certificate the decider and the executor refuse
        // the connection, which is why the probes are exec probes with the
        // pod's certificate rather than Kubernetes' built-in gRPC probe.
        if l.binary != "driver-svc" {
            ensure!(
                probe(&args, l, running, false).await.is_err(),
                "{}: a probe without a client certificate is refused",
                l.source
            );
        }
        let scraped = running.services[&l.binary].scrape().await?;
        ensure!(
            scraped.contains("grpc_server_started_total"),
            "{}: metrics served",
            l.source
        );
    }

    // The driver wants a token; with the generated one a run converges on the
    // process backend through the decider and the executor the manifests
    // name, and is deleted.
    let refused = provisionctl(running, secrets, false, &["list"]);
    ensure!(!refused.status.success(), "a call without a token is refused");
    let shape = work.join("shape.yaml");
    std::fs::write(
        &shape,
        "run_id: deployed\ngroups:\n  - id: workers\n    count: 2\n    template:\n      image: registry.local/node:1.0\n      provider: { name: process }\n      boot: { stage_delay_ms: \"20\" }\n      join: { token: { value: s3cret, secret: true } }\n",
    )?;
    let shape_arg = shape.display().to_string();
    for args in [
        vec!["apply", "-f", shape_arg.as_str(), "--wait", "--timeout", "60s"],
        vec!["delete", "deployed", "--wait", "--timeout", "60s"],
    ] {
        let out = provisionctl(running, secrets, true, &args);
        ensure!(
            out.status.success(),
            "provisionctl {args:?}: {}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let agents = procs::live_agent_pids(&running.agents_root);
    ensure!(agents.is_empty(), "node agents left after the delete: {agents:?}");

    // A clean stop on SIGTERM, the driver first.
    for binary in SERVICES.iter().rev() {
        let svc = running.services.get_mut(*binary).expect("started");
        let status = svc.terminate().await?;
        ensure!(status.success(), "{binary} exited {status} on SIGTERM");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kubernetes_manifests_start_the_binaries_and_pass_their_probes() {
    let work = tempfile::tempdir().expect("a temporary directory");
    let secrets = gen_secrets(work.path());
    run_stack(k8s_stack(&K8s::load()), &work.path().join("run"), &secrets).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_compose_services_start_the_binaries_and_pass_their_healthchecks() {
    let work = tempfile::tempdir().expect("a temporary directory");
    let secrets = gen_secrets(work.path());
    // The variables come from the compose.env gen-secrets.sh wrote.
    let vars: BTreeMap<String, String> = read(&secrets.join("compose.env"))
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    let c = compose(&vars).expect("compose.env provides every required variable");
    assert!(
        compose(&BTreeMap::new()).is_err(),
        "without compose.env the compose file says what is missing"
    );
    let uid = String::from_utf8(Command::new("id").arg("-u").output().expect("id").stdout).expect("utf-8");
    assert!(
        st(&c["services"]["driver"]["user"]).is_some_and(|u| u.starts_with(&format!("{}:", uid.trim()))),
        "the services run as the owner of the secrets"
    );
    let dir = vars["PROVISIONING_SECRETS"].clone();
    run_stack(compose_stack(&c, &dir), &work.path().join("run"), &secrets).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_systemd_units_start_the_binaries() {
    let work = tempfile::tempdir().expect("a temporary directory");
    let secrets = gen_secrets(work.path());
    run_stack(systemd_stack(), &work.path().join("run"), &secrets).await;
}

#[test]
fn systemd_analyze_accepts_the_units() {
    let tool = "systemd-analyze";
    let found = Command::new(tool).arg("--version").output();
    assert!(
        found.is_ok_and(|o| o.status.success()),
        "{tool} is not installed (Debian's systemd package has it)"
    );
    // The units name /usr/local/bin; point them at this build's binaries.
    let dir = tempfile::tempdir().expect("a temporary directory");
    let bin = procs::bin_dir().expect("the binaries");
    let mut units = Vec::new();
    for path in unit_files() {
        let text = read(&path).replace("/usr/local/bin/", &format!("{}/", bin.display()));
        let to = dir.path().join(path.file_name().expect("a name"));
        std::fs::write(&to, text).expect("writing a unit");
        units.push(to);
    }
    assert_eq!(units.len(), 3, "a unit per service");
    let verify = |units: &[PathBuf]| {
        let out = Command::new(tool)
            .arg("verify")
            .arg("--man=no")
            .args(units)
            .output()
            .expect("running systemd-analyze");
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        // It reports bad lines on stderr but still exits 0 for some.
        (
            out.status.success() && !units.iter().any(|u| stderr.contains(&u.display().to_string())),
            stderr,
        )
    };
    let (ok, stderr) = verify(&units);
    assert!(ok, "systemd-analyze verify: {stderr}");
    // A misspelt directive is caught.
    let bad = dir.path().join("bad.service");
    std::fs::write(&bad, read(&units[0]).replace("ProtectSystem=", "ProtectSystm=")).expect("writing");
    assert!(!verify(&[bad]).0, "a misspelt directive is reported");
}

#[test]
fn kubernetes_validate_accepts_the_manifests() {
    let tool = "kubernetes-validate";
    let version = Command::new(tool).arg("--version").output();
    let version = match version {
        Ok(v) => v,
        Err(e) => {
            // CI installs it (.ci/run) and must run this check; elsewhere it
            // is optional, like promtool.
            assert!(
                std::env::var("CI").is_err(),
                "{tool} is not on PATH in CI: `python3 -m pip install \
                 {tool}=={KUBERNETES_VALIDATE_VERSION}` (.ci/run installs it): {e}"
            );
            println!(
                "{tool} not installed ({e}); the schema check did not run (`python3 -m pip install \
                 {tool}=={KUBERNETES_VALIDATE_VERSION}`)"
            );
            return;
        }
    };
    assert_eq!(
        String::from_utf8_lossy(&version.stdout).trim(),
        KUBERNETES_VALIDATE_VERSION,
        "{tool}'s version (.ci/run pins it)"
    );
    let work = tempfile::tempdir().expect("a temporary directory");
    let secrets = gen_secrets(work.path());
    let mut files: Vec<PathBuf> = std::fs::read_dir(deploy("k8s"))
        .expect("deploy/k8s")
        .map(|e| e.expect("an entry").path())
        .collect();
    files.sort();
    files.push(secrets.join("k8s-secrets.yaml"));
    let validate = |files: &[PathBuf]| {
        Command::new(tool)
            .args(["--strict", "--quiet", "--kubernetes-version", KUBERNETES_VERSION])
            .args(files)
            .output()
            .expect("running kubernetes-validate")
    };
    let out = validate(&files);
    assert!(
        out.status.success(),
        "{tool} --strict -k {KUBERNETES_VERSION}:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // Every kind the manifests use was checked (none skipped for want of a
    // schema), and a misspelt field is refused.
    let kinds: BTreeSet<String> = K8s::load()
        .docs
        .iter()
        .filter_map(|(_, d)| st(&d["kind"]).map(str::to_owned))
        .collect();
    for kind in [
        "Namespace",
        "ConfigMap",
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "PersistentVolumeClaim",
        "NetworkPolicy",
    ] {
        assert!(kinds.contains(kind), "deploy/k8s has a {kind}");
    }
    let bad = work.path().join("bad.yaml");
    std::fs::write(
        &bad,
        read(&deploy("k8s/20-decider.yaml")).replace("  replicas:", "  replica:"),
    )
    .expect("writing");
    assert!(
        !validate(&[bad]).status.success(),
        "{tool} refuses an unknown field"
    );
}
