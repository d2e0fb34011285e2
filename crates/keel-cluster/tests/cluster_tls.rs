//! TLS on client and peer links: three members replicating over TLS peer links and serving
//! TLS clients (with client-certificate authentication), clients and peers that must be
//! refused (no certificate, another CA, plaintext, garbage, silence), and the startup errors
//! for missing or bad certificate files. Certificates are made at test time with rcgen.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use etcd_client::{Certificate, Client, ConnectOptions, GetOptions, Identity, TlsOptions};
use keel_cluster::network::{read_frame, write_frame, Hello, PeerRequest, PeerResponse};
use keel_cluster::tls::PeerTls;
use keel_cluster::{ServeConfig, Server, TlsFiles};

mod common;
use rcgen::{BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn base_ip(test: u8) -> String {
    common::loopback_ip(40 + test)
}

/// A certificate authority and the files of the certificates it issued.
struct Ca {
    issuer: Issuer<'static, KeyPair>,
    pem: String,
}

impl Ca {
    fn new(name: &str) -> Ca {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        let key = KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        Ca { pem: cert.pem(), issuer: Issuer::new(params, key) }
    }

    /// A certificate for `sans` (IPs or names) usable both as a server's and as a client's
    /// (a member's peer certificate is both), as PEM (cert, key).
    fn issue(&self, common_name: &str, sans: &[&str]) -> (String, String) {
        self.issue_numbered(common_name, sans, None)
    }

    /// [`Ca::issue`] with a chosen serial number (to revoke it in a CRL).
    fn issue_numbered(&self, common_name: &str, sans: &[&str], serial: Option<u64>) -> (String, String) {
        let mut params = CertificateParams::new(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap();
        params.serial_number = serial.map(rcgen::SerialNumber::from);
        params.distinguished_name.push(DnType::CommonName, common_name);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    }
}

impl Ca {
    /// A revocation list (PEM) naming the certificates with these serial numbers.
    fn crl(&self, serials: &[u64]) -> String {
        let params = rcgen::CertificateRevocationListParams {
            this_update: rcgen::date_time_ymd(2024, 1, 1),
            next_update: rcgen::date_time_ymd(2099, 1, 1),
            crl_number: rcgen::SerialNumber::from(1u64),
            issuing_distribution_point: None,
            revoked_certs: serials
                .iter()
                .map(|s| rcgen::RevokedCertParams {
                    serial_number: rcgen::SerialNumber::from(*s),
                    revocation_time: rcgen::date_time_ymd(2024, 1, 1),
                    reason_code: None,
                    invalidity_date: None,
                })
                .collect(),
            key_identifier_method: rcgen::KeyIdMethod::Sha256,
        };
        params.signed_by(&self.issuer).unwrap().pem().unwrap()
    }
}

/// Certificate files in a directory: `<name>.pem` and `<name>-key.pem`.
struct Files {
    dir: PathBuf,
}

impl Files {
    fn write(&self, name: &str, pem: &str) -> PathBuf {
        let path = self.dir.join(name);
        std::fs::write(&path, pem).unwrap();
        path
    }

    fn pair(&self, name: &str, (cert, key): (String, String)) -> (PathBuf, PathBuf) {
        (self.write(&format!("{name}.pem"), &cert), self.write(&format!("{name}-key.pem"), &key))
    }

    fn tls(&self, name: &str, pair: (String, String), ca: &Path, client_cert_auth: bool) -> TlsFiles {
        let (cert, key) = self.pair(name, pair);
        TlsFiles {
            cert_file: Some(cert),
            key_file: Some(key),
            trusted_ca_file: Some(ca.to_path_buf()),
            client_cert_auth,
            ..TlsFiles::default()
        }
    }
}

/// The PKI of one test: the cluster's CA (member and client certificates) and a stranger CA.
struct Pki {
    files: Files,
    ca: Ca,
    ca_file: PathBuf,
    other: Ca,
    other_ca_file: PathBuf,
}

impl Pki {
    fn new(dir: &Path) -> Pki {
        let files = Files { dir: dir.join("pki") };
        std::fs::create_dir_all(&files.dir).unwrap();
        let ca = Ca::new("keel test ca");
        let other = Ca::new("stranger ca");
        let ca_file = files.write("ca.pem", &ca.pem);
        let other_ca_file = files.write("other-ca.pem", &other.pem);
        Pki { files, ca, ca_file, other, other_ca_file }
    }

    /// A member's TLS for clients and for peers (both with certificate authentication).
    fn member_tls(&self, name: &str, ip: &str) -> (TlsFiles, TlsFiles) {
        let client = self.files.tls(&format!("{name}-server"), self.ca.issue(name, &[ip]), &self.ca_file, true);
        let peer = self.files.tls(&format!("{name}-peer"), self.ca.issue(name, &[ip]), &self.ca_file, true);
        (client, peer)
    }
}

fn config(dir: &Path, pki: &Pki, ip: &str, names: &[&str], i: usize) -> ServeConfig {
    let (client_tls, peer_tls) = pki.member_tls(names[i], ip);
    ServeConfig {
        max_request_bytes: ServeConfig::default().max_request_bytes,
        client_tls,
        peer_tls,
        ..common::member_config(dir, "https", ip, (24790, 24800), names, i, "tls-test")
    }
}

async fn wait_leader(servers: &[Server]) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let leaders: Vec<Option<u64>> = servers.iter().map(|s| s.node.leader()).collect();
        if let Some(Some(l)) = leaders.first() {
            if leaders.iter().all(|x| *x == Some(*l)) {
                return *l;
            }
        }
        assert!(Instant::now() < deadline, "no agreed leader over TLS peer links: {leaders:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// An etcd client over TLS trusting `ca`, presenting `identity` (cert, key) if given.
async fn tls_client(url: &str, ca: &str, identity: Option<&(String, String)>) -> Client {
    let mut tls = TlsOptions::new().ca_certificate(Certificate::from_pem(ca));
    if let Some((cert, key)) = identity {
        tls = tls.identity(Identity::from_pem(cert, key));
    }
    let opts = ConnectOptions::new()
        .with_tls(tls)
        .with_connect_timeout(Duration::from_secs(3))
        .with_timeout(Duration::from_secs(5));
    Client::connect([url], Some(opts)).await.expect("connect")
}

/// Puts `key` through a client made with `make`, retrying while the member is still
/// publishing itself; the last error if it never works.
async fn put_eventually(url: &str, ca: &str, identity: Option<&(String, String)>, key: &str) -> Result<i64, String> {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let attempt = async {
            let mut c = tls_client(url, ca, identity).await;
            c.put(key, "v", None).await.map(|r| r.header().map_or(0, |h| h.revision()))
        };
        match tokio::time::timeout(Duration::from_secs(8), attempt).await {
            Ok(Ok(rev)) => return Ok(rev),
            Ok(Err(e)) if Instant::now() > deadline => return Err(e.to_string()),
            Err(_) if Instant::now() > deadline => return Err("timed out".into()),
            _ => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

async fn stop_all(servers: Vec<Server>) {
    for s in servers {
        s.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_members_replicate_over_tls_peer_links_and_serve_tls_clients() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(dir.path());
    let ip = base_ip(1);
    let names = ["n1", "n2", "n3"];
    let mut servers = Vec::new();
    for i in 0..3 {
        servers.push(Server::start(config(dir.path(), &pki, &ip, &names, i)).await.unwrap());
    }
    // Peer URLs are https only: an elected leader means votes and heartbeats crossed TLS.
    let leader = wait_leader(&servers).await;
    let follower = servers.iter().position(|s| s.node.id != leader).unwrap();
    let url = |i: usize| format!("https://{ip}:{}", 24790 + i);
    let me = pki.ca.issue("client", &[]);

    // A write through a follower is forwarded to the leader over a TLS peer link.
    let rev = put_eventually(&url(follower), &pki.ca.pem, Some(&me), "k0").await.unwrap();
    let mut c = tls_client(&url(follower), &pki.ca.pem, Some(&me)).await;
    for i in 1..20 {
        c.put(format!("k{i}"), format!("v{i}"), None).await.unwrap();
    }
    let got = c.get("k", Some(GetOptions::new().with_prefix())).await.unwrap();
    assert_eq!(got.count(), 20);
    assert!(got.header().unwrap().revision() >= rev + 19);
    // Every member applied every write (serializable reads see only the member's own state).
    for i in 0..3 {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut ci = tls_client(&url(i), &pki.ca.pem, Some(&me)).await;
        loop {
            let n = ci.get("k", Some(GetOptions::new().with_prefix().with_serializable())).await.map(|r| r.count());
            if n.as_ref().ok() == Some(&20) {
                break;
            }
            assert!(Instant::now() < deadline, "member {i} has {n:?} of 20 keys");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let members = c.member_list().await.unwrap();
    assert!(members.members().iter().all(|m| m.peer_urls().iter().all(|u| u.starts_with("https://"))));

    // A plaintext gRPC client on the TLS port gets nothing.
    let plain = Client::connect(
        [format!("http://{ip}:{}", 24790 + follower)],
        Some(ConnectOptions::new().with_connect_timeout(Duration::from_secs(2)).with_timeout(Duration::from_secs(3))),
    )
    .await;
    if let Ok(mut plain) = plain {
        assert!(plain.get("k0", None).await.is_err(), "a plaintext client must not be served on an https URL");
    }
    stop_all(servers).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_without_a_trusted_certificate_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(dir.path());
    let ip = base_ip(2);
    let servers = vec![Server::start(config(dir.path(), &pki, &ip, &["solo"], 0)).await.unwrap()];
    wait_leader(&servers).await;
    let url = format!("https://{ip}:24790");
    let me = pki.ca.issue("client", &[]);
    // The control: a client with a certificate of the cluster's CA is served.
    put_eventually(&url, &pki.ca.pem, Some(&me), "ok").await.unwrap();

    // No certificate, while --client-cert-auth is on.
    let mut c = tls_client(&url, &pki.ca.pem, None).await;
    assert!(c.put("no-cert", "v", None).await.is_err(), "a client without a certificate must be refused");
    // A certificate of another CA.
    let stranger = pki.other.issue("client", &[]);
    let mut c = tls_client(&url, &pki.ca.pem, Some(&stranger)).await;
    assert!(c.put("stranger", "v", None).await.is_err(), "a client certificate of another CA must be refused");
    // A client that trusts another CA refuses the member.
    let mut c = tls_client(&url, &pki.other.pem, Some(&me)).await;
    assert!(c.get("ok", None).await.is_err(), "a client trusting another CA must not accept the member");

    // None of them wrote anything.
    let mut c = tls_client(&url, &pki.ca.pem, Some(&me)).await;
    let all = c.get("", Some(GetOptions::new().with_all_keys())).await.unwrap();
    assert_eq!(all.kvs().iter().map(|kv| kv.key().to_vec()).collect::<Vec<_>>(), vec![b"ok".to_vec()]);
    stop_all(servers).await;
}

/// etcd's --client-cert-auth with auth on: a request without a token acts as the user named by
/// its verified certificate's common name; a client cannot claim a name through metadata.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_verified_certificate_common_name_is_the_user_when_no_token_is_sent() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(dir.path());
    let ip = base_ip(5);
    let servers = vec![Server::start(config(dir.path(), &pki, &ip, &["solo"], 0)).await.unwrap()];
    wait_leader(&servers).await;
    let url = format!("https://{ip}:24790");
    let root_cert = pki.ca.issue("root", &[]);
    let reader_cert = pki.ca.issue("reader", &[]);
    put_eventually(&url, &pki.ca.pem, Some(&root_cert), "app/x").await.unwrap();
    put_eventually(&url, &pki.ca.pem, Some(&root_cert), "secret").await.unwrap();
    let mut admin = tls_client(&url, &pki.ca.pem, Some(&root_cert)).await;
    admin.user_add("root", "rootpw", None).await.unwrap();
    admin.user_grant_role("root", "root").await.unwrap();
    admin.user_add("reader", "readpw", None).await.unwrap();
    admin.role_add("app-read").await.unwrap();
    admin.role_grant_permission("app-read", etcd_client::Permission::read("app/").with_prefix()).await.unwrap();
    admin.user_grant_role("reader", "app-read").await.unwrap();
    admin.auth_enable().await.unwrap();

    // The certificate named root: root's rights, with no token.
    let mut root = tls_client(&url, &pki.ca.pem, Some(&root_cert)).await;
    assert_eq!(root.get("secret", None).await.unwrap().count(), 1);
    assert!(root.user_list().await.unwrap().users().contains(&"reader".to_string()));
    // The certificate named reader: only the reader's rights.
    let mut reader = tls_client(&url, &pki.ca.pem, Some(&reader_cert)).await;
    assert_eq!(reader.get("app/x", None).await.unwrap().count(), 1);
    let denied = reader.get("secret", None).await.unwrap_err();
    assert!(
        matches!(&denied, etcd_client::Error::GRpcStatus(s) if s.code() == tonic::Code::PermissionDenied),
        "{denied}"
    );
    // Claiming another name through the internal metadata key changes nothing.
    let channel = tonic::transport::Endpoint::from_shared(url.clone())
        .unwrap()
        .tls_config(
            tonic::transport::ClientTlsConfig::new()
                .ca_certificate(tonic::transport::Certificate::from_pem(&pki.ca.pem))
                .identity(tonic::transport::Identity::from_pem(&reader_cert.0, &reader_cert.1)),
        )
        .unwrap()
        .connect()
        .await
        .unwrap();
    let spoofed = raw_range(channel, b"secret", Some("root")).await.unwrap_err();
    assert_eq!(spoofed.code(), tonic::Code::PermissionDenied);
    stop_all(servers).await;
}

/// A Range of `key` over `channel` as a raw gRPC call, claiming the internal certificate-user
/// metadata key when `claimed_user` is given (as a spoofing client would).
async fn raw_range(
    channel: tonic::transport::Channel,
    key: &[u8],
    claimed_user: Option<&str>,
) -> Result<etcd_client::proto::PbRangeResponse, tonic::Status> {
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    let mut request =
        tonic::Request::new(etcd_client::proto::PbRangeRequest { key: key.to_vec(), ..Default::default() });
    if let Some(user) = claimed_user {
        request.metadata_mut().insert(keel_cluster::auth_api::CERT_USER, user.parse().unwrap());
    }
    let path = tonic::codegen::http::uri::PathAndQuery::from_static("/etcdserverpb.KV/Range");
    let codec =
        tonic_prost::ProstCodec::<etcd_client::proto::PbRangeRequest, etcd_client::proto::PbRangeResponse>::default();
    grpc.unary(request, path, codec).await.map(tonic::Response::into_inner)
}

/// etcd's `--client-crl-file`: a client whose certificate the list revokes is refused at the
/// handshake; another certificate of the same CA is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_client_certificate_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(dir.path());
    let ip = base_ip(10);
    let mut cfg = config(dir.path(), &pki, &ip, &["solo"], 0);
    cfg.client_tls.crl_file = Some(pki.files.write("revoked.crl", &pki.ca.crl(&[4242])));
    let servers = vec![Server::start(cfg).await.unwrap()];
    wait_leader(&servers).await;
    let url = format!("https://{ip}:24790");
    let good = pki.ca.issue_numbered("good", &[], Some(77));
    put_eventually(&url, &pki.ca.pem, Some(&good), "ok").await.unwrap();
    let revoked = pki.ca.issue_numbered("revoked", &[], Some(4242));
    let mut c = tls_client(&url, &pki.ca.pem, Some(&revoked)).await;
    assert!(c.put("revoked", "v", None).await.is_err(), "a revoked certificate must be refused");
    let mut c = tls_client(&url, &pki.ca.pem, Some(&good)).await;
    assert_eq!(c.get("revoked", None).await.unwrap().count(), 0);
    stop_all(servers).await;
}

/// One port for `http://` and `https://` (etcd serves both when both URLs name it), and a Unix
/// domain socket (`unix://`), each answering gRPC.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_port_serves_http_and_https_and_a_unix_socket_serves_too() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(dir.path());
    let ip = base_ip(11);
    let mut cfg = config(dir.path(), &pki, &ip, &["solo"], 0);
    cfg.client_tls.client_cert_auth = false;
    let socket = dir.path().join("keel.sock");
    cfg.listen_client_urls =
        vec![format!("http://{ip}:24790"), format!("https://{ip}:24790"), format!("unix://{}", socket.display())];
    let servers = vec![Server::start(cfg).await.unwrap()];
    wait_leader(&servers).await;
    put_eventually(&format!("https://{ip}:24790"), &pki.ca.pem, None, "over-tls").await.unwrap();
    let mut plain = Client::connect([format!("http://{ip}:24790")], None).await.unwrap();
    assert_eq!(plain.get("over-tls", None).await.unwrap().count(), 1);
    plain.put("over-plain", "v", None).await.unwrap();
    // A unix socket: tonic with a connector that dials the socket file.
    let path = socket.clone();
    let channel = tonic::transport::Endpoint::from_static("http://unix.socket")
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let path = path.clone();
            async move { tokio::net::UnixStream::connect(path).await.map(hyper_util::rt::TokioIo::new) }
        }))
        .await
        .unwrap();
    let got = raw_range(channel, b"over-plain", None).await.unwrap();
    assert_eq!(got.kvs.len(), 1);
    stop_all(servers).await;
}

/// Peer links over Unix sockets (`unix://` peer URLs, as etcd's test framework uses): three
/// members elect a leader and replicate a write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_replicate_over_unix_socket_peer_links() {
    let dir = tempfile::tempdir().unwrap();
    let ip = base_ip(12);
    let names = ["u1", "u2", "u3"];
    let peer = |n: usize| format!("unix://{}", dir.path().join(format!("{}.peer", names[n])).display());
    let mut servers = Vec::new();
    for i in 0..names.len() {
        let mut cfg = common::member_config(dir.path(), "http", &ip, (24810, 24820), &names, i, "unix-peers");
        cfg.listen_peer_urls = vec![peer(i)];
        cfg.initial_advertise_peer_urls = vec![peer(i)];
        cfg.initial_cluster = names.iter().enumerate().map(|(n, name)| (name.to_string(), vec![peer(n)])).collect();
        servers.push(Server::start(cfg).await.unwrap());
    }
    wait_leader(&servers).await;
    let urls: Vec<String> = (0..names.len()).map(|i| format!("http://{ip}:{}", 24810 + i)).collect();
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut first = Client::connect([urls[0].clone()], None).await.unwrap();
    while first.put("over-unix", "v", None).await.is_err() {
        assert!(Instant::now() < deadline, "no write over unix peer links");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut last = Client::connect([urls[2].clone()], None).await.unwrap();
    assert_eq!(last.get("over-unix", None).await.unwrap().count(), 1);
    stop_all(servers).await;
}

/// Sends a hello and a read-index request over `stream`; the answer, or why there was none.
async fn ask_read_index<S>(stream: S, cluster_id: u64, to: u64) -> Result<PeerResponse, String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let (mut r, mut w) = tokio::io::split(stream);
    let hello = Hello { magic: 0x4b45_454c_5045_4552, cluster_id, from: 7, to };
    write_frame(&mut w, &hello).await.map_err(|e| e.to_string())?;
    write_frame(&mut w, &PeerRequest::ReadIndex).await.map_err(|e| e.to_string())?;
    match tokio::time::timeout(Duration::from_secs(5), read_frame::<PeerResponse>(&mut r)).await {
        Ok(r) => r.map_err(|e| e.to_string()),
        Err(_) => Err("no answer in 5 s".into()),
    }
}

/// Whether the member closes `s` within `within` (EOF or a reset, not a hang).
async fn closed_within(s: &mut tokio::net::TcpStream, within: Duration) -> bool {
    let mut buf = [0u8; 256];
    let deadline = Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline.into(), s.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            // A TLS alert may come before the close.
            Ok(Ok(_)) => continue,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_peer_port_refuses_plaintext_garbage_silence_and_peers_of_another_ca() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(dir.path());
    let ip = base_ip(3);
    let servers = vec![Server::start(config(dir.path(), &pki, &ip, &["solo"], 0)).await.unwrap()];
    wait_leader(&servers).await;
    let node = &servers[0].node;
    let peer_url = format!("https://{ip}:24800");
    let peer_addr = format!("{ip}:24800");

    // The control: a peer with a certificate of the cluster's CA gets an answer.
    let friend = PeerTls::load(&pki.files.tls("friend", pki.ca.issue("friend", &[]), &pki.ca_file, false)).unwrap();
    let answer = ask_read_index(friend.connect(&peer_url).await.unwrap(), node.cluster_id, node.id).await;
    assert!(matches!(answer, Ok(PeerResponse::ReadIndex(_))), "{answer:?}");
    // ... and the cluster-id check still applies inside TLS.
    let answer = ask_read_index(friend.connect(&peer_url).await.unwrap(), node.cluster_id ^ 1, node.id).await;
    assert!(answer.is_err(), "a TLS peer of another cluster must get no answer: {answer:?}");

    // A peer whose certificate another CA signed (it trusts ours, so only its own
    // certificate is wrong): refused during or right after the handshake.
    let stranger =
        PeerTls::load(&pki.files.tls("stranger", pki.other.issue("stranger", &[]), &pki.ca_file, false)).unwrap();
    let answer = match stranger.connect(&peer_url).await {
        Ok(s) => ask_read_index(s, node.cluster_id, node.id).await,
        Err(e) => Err(e.to_string()),
    };
    assert!(answer.is_err(), "a peer certificate of another CA must be refused: {answer:?}");
    // A dialler that trusts only another CA refuses the member's certificate itself.
    let suspicious =
        PeerTls::load(&pki.files.tls("wary", pki.ca.issue("wary", &[]), &pki.other_ca_file, false)).unwrap();
    assert!(suspicious.connect(&peer_url).await.is_err());

    // A plaintext KeelDB hello on the TLS port.
    let mut s = tokio::net::TcpStream::connect(&peer_addr).await.unwrap();
    let hello = Hello { magic: 0x4b45_454c_5045_4552, cluster_id: node.cluster_id, from: 7, to: node.id };
    write_frame(&mut s, &hello).await.unwrap();
    let _ = write_frame(&mut s, &PeerRequest::ReadIndex).await;
    assert!(closed_within(&mut s, Duration::from_secs(5)).await, "plaintext on a TLS peer port must be closed");
    // Random bytes.
    let mut s = tokio::net::TcpStream::connect(&peer_addr).await.unwrap();
    let junk: Vec<u8> = (0..4096u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    let _ = s.write_all(&junk).await;
    assert!(closed_within(&mut s, Duration::from_secs(5)).await, "garbage on a TLS peer port must be closed");
    // Silence: the handshake timeout closes the connection; the member is not stalled meanwhile.
    let mut silent = tokio::net::TcpStream::connect(&peer_addr).await.unwrap();
    let answer = ask_read_index(friend.connect(&peer_url).await.unwrap(), node.cluster_id, node.id).await;
    assert!(matches!(answer, Ok(PeerResponse::ReadIndex(_))), "{answer:?}");
    let timeout = keel_cluster::tls::HANDSHAKE_TIMEOUT + Duration::from_secs(5);
    assert!(
        closed_within(&mut silent, timeout).await,
        "a silent connection must be dropped after the handshake timeout"
    );

    // The member still serves clients.
    let me = pki.ca.issue("client", &[]);
    put_eventually(&format!("https://{ip}:24790"), &pki.ca.pem, Some(&me), "after").await.unwrap();
    stop_all(servers).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_or_bad_certificate_files_fail_the_start_with_the_flag_named() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(dir.path());
    let ip = base_ip(4);
    let base = config(dir.path(), &pki, &ip, &["solo"], 0);
    let start_err = |cfg: ServeConfig| async move {
        let data_dir = cfg.data_dir.clone();
        let err = Server::start(cfg).await.err().expect("must refuse to start").to_string();
        assert!(!data_dir.exists(), "a refused start must not create the data dir ({err})");
        err
    };

    // An https client URL without --cert-file.
    let mut c = base.clone();
    c.client_tls = TlsFiles::default();
    let err = start_err(c).await;
    assert!(err.contains("--cert-file") && err.contains("https://"), "{err}");
    // An https peer URL without --peer-cert-file, and without --peer-trusted-ca-file.
    let mut c = base.clone();
    c.peer_tls = TlsFiles::default();
    assert!(start_err(c).await.contains("--peer-cert-file"));
    let mut c = base.clone();
    c.peer_tls.trusted_ca_file = None;
    c.peer_tls.client_cert_auth = false;
    assert!(start_err(c).await.contains("--peer-trusted-ca-file"));
    // A certificate without its key, and --client-cert-auth without a CA.
    let mut c = base.clone();
    c.client_tls.key_file = None;
    assert!(start_err(c).await.contains("--key-file"));
    let mut c = base.clone();
    c.client_tls.trusted_ca_file = None;
    assert!(start_err(c).await.contains("--client-cert-auth"));
    // An unreadable file, a file that is not PEM, a key of another certificate, a CA file
    // that holds a key.
    let mut c = base.clone();
    c.client_tls.cert_file = Some(dir.path().join("nope.pem"));
    let err = start_err(c).await;
    assert!(err.contains("--cert-file") && err.contains("cannot read"), "{err}");
    let mut c = base.clone();
    c.peer_tls.cert_file = Some(pki.files.write("junk.pem", "not a certificate\n"));
    let err = start_err(c).await;
    assert!(err.contains("--peer-cert-file") && err.contains("no PEM certificate"), "{err}");
    let mut c = base.clone();
    let (_, other_key) = pki.files.pair("unrelated", pki.ca.issue("unrelated", &[]));
    c.client_tls.key_file = Some(other_key);
    assert!(start_err(c).await.contains("--key-file"));
    let mut c = base.clone();
    c.peer_tls.trusted_ca_file = base.peer_tls.key_file.clone();
    let err = start_err(c).await;
    assert!(err.contains("--peer-trusted-ca-file"), "{err}");

    // Certificate flags beside http URLs are allowed (as in etcd): the listeners are plain.
    let mut c = base.clone();
    for urls in [&mut c.listen_client_urls, &mut c.advertise_client_urls] {
        urls[0] = urls[0].replace("https://", "http://");
    }
    assert!(c.validate().is_ok());
    let server = Server::start(c).await.unwrap();
    wait_leader(std::slice::from_ref(&server)).await;
    let mut plain = Client::connect([format!("http://{ip}:24790")], None).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    while plain.put("plain", "v", None).await.is_err() {
        assert!(Instant::now() < deadline, "the http client URL must serve plaintext");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    server.stop().await;
}
