//! `keel serve` started the way etcd's e2e framework and operators' scripts start etcd: etcd's
//! command line (repeated flags, Go's single-dash form, flags KeelDB only accepts at some
//! values), etcd's ready line on stderr once the member serves (and not before: a member alone
//! of three cannot publish itself), `--auto-tls` reached by a TLS client, refused flags, and
//! the version lines under the names `keel serve` and `etcd`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const BASE: u16 = 27510;
const READY: &str = "ready to serve client requests";

/// A `keel serve` process whose stderr lines arrive on `lines`.
struct Member {
    child: Child,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl Member {
    /// Starts `PROGRAM serve ARGS`, or `PROGRAM ARGS` without `serve_subcommand`.
    fn start(program: &Path, serve_subcommand: bool, args: &[String]) -> Member {
        let mut cmd = Command::new(program);
        if serve_subcommand {
            cmd.arg("serve");
        }
        let mut child =
            cmd.args(args).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().expect("starting keel serve");
        let stderr = child.stderr.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { return };
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        Member { child, lines, seen: Vec::new() }
    }

    /// Waits up to `within` for a stderr line containing `text`; returns it.
    fn wait_for(&mut self, text: &str, within: Duration) -> Option<String> {
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.checked_duration_since(Instant::now())?;
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if line.contains(text) {
                        return Some(line);
                    }
                }
                Err(_) => return None,
            }
        }
    }

    fn log(&self) -> String {
        self.seen.join("\n")
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn keel() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_keel"))
}

fn run(program: &Path, args: &[&str]) -> Output {
    Command::new(program).args(args).output().expect("running keel")
}

fn client_url(scheme: &str, i: u16) -> String {
    format!("{scheme}://127.0.0.1:{}", BASE + 2 * i)
}

fn peer_url(scheme: &str, i: u16) -> String {
    format!("{scheme}://127.0.0.1:{}", BASE + 2 * i + 1)
}

/// Member `i`'s command line as etcd's e2e framework writes it: `--flag=value` and
/// `--data-dir DIR`, the token given twice (the framework's explicit flag, then its
/// non-default config value; here the first differs per member, so only if the last value
/// wins do the members form one cluster), plus Go's single-dash form and flags KeelDB accepts
/// only at the value it behaves as.
fn e2e_args(dir: &Path, i: u16, n: u16, scheme: &str) -> Vec<String> {
    e2e_args_peers(dir, (i, 0..n), scheme, "http")
}

/// [`e2e_args`] for member `i` of the members `ids`, peers on `peer_scheme`.
fn e2e_args_peers(dir: &Path, (i, ids): (u16, std::ops::Range<u16>), scheme: &str, peer_scheme: &str) -> Vec<String> {
    let cluster: Vec<String> = ids.map(|j| format!("m{j}={}", peer_url(peer_scheme, j))).collect();
    let url = client_url(scheme, i);
    vec![
        format!("--name=m{i}"),
        format!("--listen-client-urls={url}"),
        format!("--advertise-client-urls={url}"),
        format!("--listen-peer-urls={}", peer_url(peer_scheme, i)),
        format!("--initial-advertise-peer-urls={}", peer_url(peer_scheme, i)),
        format!("--initial-cluster-token=first-{i}"),
        "--data-dir".into(),
        dir.join(format!("m{i}")).display().to_string(),
        "--snapshot-count=10000".into(),
        "--strict-reconfig-check=false".into(),
        "--initial-cluster-token=new".into(),
        format!("-initial-cluster={}", cluster.join(",")),
        "-initial-cluster-state".into(),
        "new".into(),
        "--experimental-initial-corrupt-check=false".into(),
    ]
}

/// The ready line is etcd's zap JSON shape.
fn check_ready_line(line: &str) {
    let v: serde_json::Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{line}: {e}"));
    assert_eq!(v["level"], "info", "{line}");
    assert_eq!(v["msg"], READY, "{line}");
    assert!(v["caller"].is_string(), "{line}");
    let ts = v["ts"].as_str().unwrap();
    assert!(ts.len() == 27 && ts.ends_with('Z') && ts.as_bytes()[10] == b'T', "{ts}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_prints_etcds_ready_line_only_once_it_serves_and_has_published_itself() {
    let dir = tempfile::tempdir().unwrap();
    let mut first = Member::start(keel(), true, &e2e_args(dir.path(), 0, 3, "http"));
    // Alone, the member cannot publish itself (no quorum), so it must not say it is ready.
    assert!(
        first.wait_for(READY, Duration::from_secs(3)).is_none(),
        "ready before the member could publish itself:\n{}",
        first.log()
    );
    let mut others: Vec<Member> =
        (1..3).map(|i| Member::start(keel(), true, &e2e_args(dir.path(), i, 3, "http"))).collect();
    let mut members = vec![first];
    members.append(&mut others);
    for (i, m) in members.iter_mut().enumerate() {
        let line = m.wait_for(READY, Duration::from_secs(60));
        let line = line.unwrap_or_else(|| panic!("member {i} never printed the ready line:\n{}", m.log()));
        check_ready_line(&line);
        // At the ready line the member serves, and MemberList shows its client URL.
        let url = client_url("http", i as u16);
        let mut c = etcd_client::Client::connect([url.as_str()], None).await.unwrap();
        c.put(format!("k{i}"), "v", None).await.unwrap();
        let list = c.member_list().await.unwrap();
        assert!(list.members().iter().any(|m| m.client_urls() == [url.clone()]), "{url} not published");
    }
    // The last of the repeated tokens is in force: one cluster id across the three.
    let mut ids = Vec::new();
    for i in 0..3 {
        let url = client_url("http", i);
        let mut c = etcd_client::Client::connect([url.as_str()], None).await.unwrap();
        ids.push(c.status().await.unwrap().header().unwrap().cluster_id());
    }
    assert!(ids.iter().all(|id| *id == ids[0]), "{ids:x?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_tls_makes_a_certificate_and_serves_tls_clients() {
    let dir = tempfile::tempdir().unwrap();
    let i = 4;
    let mut args = e2e_args_peers(dir.path(), (i, i..i + 1), "https", "http");
    args.push("--auto-tls".into());
    let mut m = Member::start(keel(), true, &args);
    let line = m.wait_for(READY, Duration::from_secs(60));
    assert!(line.is_some(), "never ready:\n{}", m.log());
    assert!(m.wait_for("serving client traffic securely", Duration::from_secs(5)).is_some(), "{}", m.log());
    // etcd's place and names for the pair; the key readable by its owner only.
    let fixtures = dir.path().join(format!("m{i}")).join("fixtures").join("client");
    let cert = std::fs::read(fixtures.join("cert.pem")).unwrap();
    let key_mode =
        std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(fixtures.join("key.pem")).unwrap().permissions());
    assert_eq!(key_mode & 0o077, 0, "key.pem is {key_mode:o}");
    // A TLS client that trusts this self-signed certificate (it names 127.0.0.1) is served.
    let url = client_url("https", i);
    let tls = etcd_client::TlsOptions::new().ca_certificate(etcd_client::Certificate::from_pem(cert));
    let opts = etcd_client::ConnectOptions::new().with_tls(tls).with_connect_timeout(Duration::from_secs(5));
    let mut c = etcd_client::Client::connect([url.as_str()], Some(opts)).await.unwrap();
    c.put("tls", "yes", None).await.unwrap();
    let got = c.get("tls", None).await.unwrap();
    assert_eq!(got.kvs()[0].value(), b"yes");
    // Plaintext on the same port is not served.
    let plain = format!("http://127.0.0.1:{}", BASE + 2 * i);
    let opts = etcd_client::ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(2))
        .with_timeout(Duration::from_secs(2));
    let plain_put = match etcd_client::Client::connect([plain.as_str()], Some(opts)).await {
        Ok(mut c) => c.put("plain", "no", None).await.is_ok(),
        Err(_) => false,
    };
    assert!(!plain_put, "a plaintext client was served on the TLS port");
}

/// etcd's e2e `NewConfigAutoTLS`: three members on https peer URLs with `--peer-auto-tls`,
/// each with its own self-signed certificate, which the others dial without a CA.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_auto_tls_members_form_one_cluster() {
    let dir = tempfile::tempdir().unwrap();
    let ids = 5..8;
    let mut members: Vec<Member> = ids
        .clone()
        .map(|i| {
            let mut args = e2e_args_peers(dir.path(), (i, ids.clone()), "http", "https");
            args.push("--peer-auto-tls".into());
            Member::start(keel(), true, &args)
        })
        .collect();
    for (m, i) in members.iter_mut().zip(ids.clone()) {
        assert!(m.wait_for(READY, Duration::from_secs(60)).is_some(), "member {i} never ready:\n{}", m.log());
        let peer = dir.path().join(format!("m{i}")).join("fixtures").join("peer");
        assert!(peer.join("cert.pem").is_file() && peer.join("key.pem").is_file());
    }
    let urls: Vec<String> = ids.clone().map(|i| client_url("http", i)).collect();
    let mut c = etcd_client::Client::connect(&urls, None).await.unwrap();
    c.put("over", "tls peers", None).await.unwrap();
    assert_eq!(c.member_list().await.unwrap().members().len(), 3);
    // A plaintext dial of a peer port gets no peer service: the port speaks TLS only.
    use std::io::{Read, Write};
    let mut raw = std::net::TcpStream::connect(("127.0.0.1", BASE + 2 * ids.start + 1)).unwrap();
    raw.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
    raw.write_all(b"hello, plaintext\r\n\r\n").unwrap();
    let mut buf = [0u8; 64];
    let n = raw.read(&mut buf).unwrap_or(0);
    assert!(n == 0 || buf[0] == 0x15, "a TLS peer port answered plaintext with {:?}", &buf[..n]);
}

#[test]
fn refused_and_unknown_flags_stop_the_start_naming_the_flag() {
    for (args, named) in [
        (&["serve", "--quota-backend-bytes=8589934592"][..], "--quota-backend-bytes"),
        (&["serve", "--force-new-cluster=true"], "--force-new-cluster"),
        (&["serve", "-auth-token", "jwt,pub-key=p,priv-key=k,sign-method=RS256"], "--auth-token"),
        (&["serve", "--max-learners=2"], "--max-learners"),
    ] {
        let out = run(keel(), args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(named) && err.contains("KeelDB does not support"), "{args:?}: {err}");
    }
    // Not an etcd flag at all: etcd's own complaint and exit code.
    let out = run(keel(), &["serve", "--enable-v2=true"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("flag provided but not defined: -enable-v2"));
}

#[test]
fn version_prints_etcds_lines_under_both_names() {
    let dir = tempfile::tempdir().unwrap();
    let etcd = dir.path().join("etcd");
    std::os::unix::fs::symlink(keel(), &etcd).unwrap();
    for out in [run(keel(), &["serve", "--version"]), run(&etcd, &["--version"]), run(&etcd, &["-version"])] {
        assert_eq!(out.status.code(), Some(0));
        let text = String::from_utf8_lossy(&out.stdout);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "etcd Version: 3.6.16", "{text}");
        assert!(lines[1].starts_with("Git SHA: "), "{text}");
        assert!(lines[2].starts_with("Go Version: "), "{text}");
        assert!(lines[3].starts_with("Go OS/Arch: linux/"), "{text}");
        assert_eq!(lines[4], format!("KeelDB Version: {}", env!("CARGO_PKG_VERSION")), "{text}");
    }
    // Under the name etcd, the binary is `keel serve`: it refuses what keel serve refuses.
    let out = run(&etcd, &["--max-learners=1"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--max-learners"));
}
