//! TLS on the wire: etcd's certificate flags loaded into rustls configurations, the TLS
//! settings of the client listeners (tonic's), and the TLS wrapping of peer links.
//!
//! This module owns reading certificate files and running handshakes. It knows nothing of
//! frames, hellos or Raft: the peer protocol runs unchanged inside the TLS stream, and the
//! hello's cluster-id check still applies after a handshake succeeds (TLS says who signed a
//! member's certificate, not which cluster it belongs to). Every file is read and checked when
//! the member starts, so a bad path or PEM is a startup error, never a failure on first use.
//! A handshake is bounded by [`HANDSHAKE_TIMEOUT`]; garbage or plaintext on a TLS port ends
//! that connection and nothing else. It also makes etcd's self-signed certificates for
//! `--auto-tls` and `--peer-auto-tls` ([`self_signed`]).

use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, CertificateRevocationListDer, PrivateKeyDer, ServerName, UnixTime};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio_rustls::rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use tokio_rustls::rustls::crypto::{ring, verify_tls12_signature, verify_tls13_signature, CryptoProvider};
use tokio_rustls::rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::{
    ClientConfig, DigitallySignedStruct, DistinguishedName, RootCertStore, ServerConfig, SignatureScheme,
    SupportedCipherSuite, SupportedProtocolVersion,
};
use tokio_rustls::{TlsAcceptor, TlsConnector};

use crate::config::{is_https, is_unix, ConfigError, TlsFiles, TlsFlags, CLIENT_TLS_FLAGS, PEER_TLS_FLAGS};
use crate::network::url_addr;

/// Longest a TLS handshake may take, on either side, before the connection is dropped.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// rustls with ring only, named explicitly so that no other crate's choice of provider can
/// change (or make ambiguous) what the member uses, with only the cipher suites `--cipher-suites` names (Go's names, as etcd takes
/// them); every suite when the list is empty. A name rustls does not have is a start error.
fn provider_for(files: &TlsFiles) -> Result<Arc<CryptoProvider>, ConfigError> {
    let mut p = ring::default_provider();
    if files.cipher_suites.is_empty() {
        return Ok(Arc::new(p));
    }
    let mut chosen: Vec<SupportedCipherSuite> = Vec::new();
    for name in &files.cipher_suites {
        let suite = p
            .cipher_suites
            .iter()
            .find(|s| go_suite_name(s).is_some_and(|n| n == name || go_legacy_name(n) == Some(name.as_str())))
            .ok_or_else(|| ConfigError::Invalid {
                flag: "--cipher-suites",
                why: format!("{name:?} is not a cipher suite KeelDB supports (ECDHE with AES-GCM or ChaCha20)"),
            })?;
        chosen.push(*suite);
    }
    // TLS 1.3's suites are not configurable in Go (and so in etcd): always offered.
    chosen.extend(p.cipher_suites.iter().filter(|s| s.tls13().is_some()).copied());
    p.cipher_suites = chosen;
    Ok(Arc::new(p))
}

/// Go's `tls.CipherSuiteName` of a TLS 1.2 suite rustls has (TLS 1.3 suites: `None`).
fn go_suite_name(s: &SupportedCipherSuite) -> Option<&'static str> {
    use tokio_rustls::rustls::CipherSuite::*;
    Some(match s.suite() {
        TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256 => "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256",
        TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384 => "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384",
        TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256 => "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256",
        TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256 => "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256",
        TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384 => "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384",
        TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256 => "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256",
        _ => return None,
    })
}

/// Go's older names of the ChaCha20 suites (`tls.CipherSuiteName` accepts both in etcd).
fn go_legacy_name(name: &str) -> Option<&'static str> {
    match name {
        "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256" => Some("TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305"),
        "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256" => Some("TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305"),
        _ => None,
    }
}

/// The protocol versions `--tls-min-version` and `--tls-max-version` allow (validated before).
fn versions(files: &TlsFiles) -> &'static [&'static SupportedProtocolVersion] {
    use tokio_rustls::rustls::version::{TLS12, TLS13};
    static ONLY_13: [&SupportedProtocolVersion; 1] = [&TLS13];
    static ONLY_12: [&SupportedProtocolVersion; 1] = [&TLS12];
    static BOTH: [&SupportedProtocolVersion; 2] = [&TLS13, &TLS12];
    match (files.min_version.as_str(), files.max_version.as_str()) {
        ("TLS1.3", _) => &ONLY_13,
        (_, "TLS1.2") => &ONLY_12,
        _ => &BOTH,
    }
}

/// The client-certificate verifier: webpki's chain check, then (if set) one of etcd's allowed
/// common names or host names (`--peer-cert-allowed-cn`, `--peer-cert-allowed-hostname`,
/// `--client-cert-allowed-hostname`). Like Go's verifier, which etcd uses, it also takes a
/// certificate that is itself in the trusted CA file (a self-signed certificate serving as
/// both CA and client, as etcd's test fixtures do); webpki refuses a CA certificate as an end
/// entity.
#[derive(Debug)]
struct AllowedNames {
    inner: Arc<dyn ClientCertVerifier>,
    cns: Vec<String>,
    hostnames: Vec<String>,
    /// The trusted CA certificates, DER.
    anchors: Vec<CertificateDer<'static>>,
}

impl AllowedNames {
    /// Whether `der` is one of the trusted certificates and valid at `now`.
    fn is_trusted_itself(&self, der: &[u8], now: UnixTime) -> bool {
        if !self.anchors.iter().any(|a| a.as_ref() == der) {
            return false;
        }
        let Ok((_, cert)) = x509_parser::parse_x509_certificate(der) else { return false };
        let now = now.as_secs() as i64;
        cert.validity().not_before.timestamp() <= now && now <= cert.validity().not_after.timestamp()
    }

    fn admits(&self, der: &[u8]) -> bool {
        if self.cns.is_empty() && self.hostnames.is_empty() {
            return true;
        }
        let Ok((_, cert)) = x509_parser::parse_x509_certificate(der) else { return false };
        if !self.cns.is_empty() {
            return cert
                .subject()
                .iter_common_name()
                .filter_map(|cn| cn.as_str().ok())
                .any(|cn| self.cns.iter().any(|allowed| allowed == cn));
        }
        let Ok(Some(san)) = cert.subject_alternative_name() else { return false };
        self.hostnames.iter().any(|host| {
            san.value.general_names.iter().any(|name| match name {
                x509_parser::extensions::GeneralName::DNSName(dns) => dns_matches(dns, host),
                x509_parser::extensions::GeneralName::IPAddress(ip) => {
                    host.parse::<std::net::IpAddr>().is_ok_and(|h| match h {
                        std::net::IpAddr::V4(v4) => *ip == v4.octets(),
                        std::net::IpAddr::V6(v6) => *ip == v6.octets(),
                    })
                }
                _ => false,
            })
        })
    }
}

/// Whether a certificate's DNS name (possibly `*.example.com`) covers `host`, case-insensitive.
fn dns_matches(pattern: &str, host: &str) -> bool {
    let (pattern, host) = (pattern.to_ascii_lowercase(), host.to_ascii_lowercase());
    match pattern.strip_prefix("*.") {
        Some(suffix) => host.split_once('.').is_some_and(|(label, rest)| !label.is_empty() && rest == suffix),
        None => pattern == host,
    }
}

impl ClientCertVerifier for AllowedNames {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.inner.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, tokio_rustls::rustls::Error> {
        let verified = match self.inner.verify_client_cert(end_entity, intermediates, now) {
            Ok(v) => v,
            Err(_) if self.is_trusted_itself(end_entity.as_ref(), now) => ClientCertVerified::assertion(),
            Err(e) => return Err(e),
        };
        if !self.admits(end_entity.as_ref()) {
            return Err(tokio_rustls::rustls::Error::General(
                "client certificate authentication failed (not an allowed name)".into(),
            ));
        }
        Ok(verified)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, tokio_rustls::rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, tokio_rustls::rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

fn tls_err(flag: &'static str, path: &Path, why: impl std::fmt::Display) -> ConfigError {
    ConfigError::Tls { flag, path: path.display().to_string(), why: why.to_string() }
}

fn read_file(flag: &'static str, path: &Path) -> Result<Vec<u8>, ConfigError> {
    std::fs::read(path).map_err(|e| tls_err(flag, path, format!("cannot read: {e}")))
}

fn parse_certs(flag: &'static str, path: &Path, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, ConfigError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| tls_err(flag, path, format!("not a PEM certificate file: {e}")))?;
    if certs.is_empty() {
        return Err(tls_err(flag, path, "holds no PEM certificate"));
    }
    Ok(certs)
}

fn parse_key(flag: &'static str, path: &Path, pem: &[u8]) -> Result<PrivateKeyDer<'static>, ConfigError> {
    PrivateKeyDer::from_pem_slice(pem).map_err(|e| tls_err(flag, path, format!("holds no usable PEM private key: {e}")))
}

fn parse_roots(flag: &'static str, path: &Path, pem: &[u8]) -> Result<Arc<RootCertStore>, ConfigError> {
    let mut roots = RootCertStore::empty();
    for cert in parse_certs(flag, path, pem)? {
        roots.add(cert).map_err(|e| tls_err(flag, path, format!("not a usable CA certificate: {e}")))?;
    }
    Ok(Arc::new(roots))
}

/// One side's files, read and parsed.
struct Loaded {
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    /// The CA file's PEM and its certificates, if given.
    roots: Option<(Vec<u8>, Arc<RootCertStore>)>,
    /// The revocation lists of `--client-crl-file` / `--peer-crl-file`.
    crls: Vec<CertificateRevocationListDer<'static>>,
}

/// A CRL file: PEM (one or more `X509 CRL` blocks) or a single DER list, as etcd reads it.
fn parse_crls(
    flag: &'static str,
    path: &Path,
    bytes: &[u8],
) -> Result<Vec<CertificateRevocationListDer<'static>>, ConfigError> {
    if bytes.starts_with(b"-----") {
        let crls = CertificateRevocationListDer::pem_slice_iter(bytes)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| tls_err(flag, path, format!("not a PEM CRL file: {e}")))?;
        if crls.is_empty() {
            return Err(tls_err(flag, path, "holds no PEM certificate revocation list"));
        }
        return Ok(crls);
    }
    <x509_parser::revocation_list::CertificateRevocationList as x509_parser::prelude::FromDer<_>>::from_der(bytes)
        .map_err(|e| tls_err(flag, path, format!("not a certificate revocation list: {e}")))?;
    Ok(vec![CertificateRevocationListDer::from(bytes.to_vec())])
}

/// Reads and parses `files`; `None` if no certificate is configured.
fn load(files: &TlsFiles, flags: TlsFlags) -> Result<Option<Loaded>, ConfigError> {
    let roots = match &files.trusted_ca_file {
        Some(path) => {
            let pem = read_file(flags.trusted_ca_file, path)?;
            let store = parse_roots(flags.trusted_ca_file, path, &pem)?;
            Some((pem, store))
        }
        None => None,
    };
    let crls = match &files.crl_file {
        Some(path) => parse_crls(flags.crl_file, path, &read_file(flags.crl_file, path)?)?,
        None => Vec::new(),
    };
    let (Some(cert_path), Some(key_path)) = (&files.cert_file, &files.key_file) else { return Ok(None) };
    let cert_pem = read_file(flags.cert_file, cert_path)?;
    let key_pem = read_file(flags.key_file, key_path)?;
    let chain = parse_certs(flags.cert_file, cert_path, &cert_pem)?;
    let key = parse_key(flags.key_file, key_path, &key_pem)?;
    Ok(Some(Loaded { chain, key, roots, crls }))
}

/// A rustls server configuration: this side's certificate, and with `client_cert_auth` a
/// verifier that requires a client certificate signed by the trusted CA.
fn server_config(files: &TlsFiles, flags: TlsFlags, loaded: &Loaded) -> Result<ServerConfig, ConfigError> {
    let cert_path = files.cert_file.as_deref().unwrap_or(Path::new(""));
    let provider = provider_for(files)?;
    let builder = ServerConfig::builder_with_provider(Arc::clone(&provider))
        .with_protocol_versions(versions(files))
        .map_err(|e| tls_err(flags.cert_file, cert_path, e))?;
    let builder = match (&loaded.roots, files.client_cert_auth) {
        (Some((pem, roots)), true) => {
            let ca_path = files.trusted_ca_file.as_deref().unwrap_or(Path::new(""));
            let mut verifier = WebPkiClientVerifier::builder_with_provider(Arc::clone(roots), provider);
            if !loaded.crls.is_empty() {
                // A revoked certificate is refused; one whose issuer published no list here is
                // not (etcd checks serial numbers against the file the same way).
                verifier = verifier.with_crls(loaded.crls.iter().cloned()).allow_unknown_revocation_status();
            }
            let verifier = verifier.build().map_err(|e| tls_err(flags.trusted_ca_file, ca_path, e))?;
            builder.with_client_cert_verifier(Arc::new(AllowedNames {
                inner: verifier,
                cns: files.allowed_cns.clone(),
                hostnames: files.allowed_hostnames.clone(),
                anchors: parse_certs(flags.trusted_ca_file, ca_path, pem)?,
            }))
        }
        (None, true) => {
            return Err(ConfigError::Invalid {
                flag: flags.client_cert_auth,
                why: format!("needs {}", flags.trusted_ca_file),
            })
        }
        (_, false) => builder.with_no_client_auth(),
    };
    // with_single_cert also checks that the key belongs to the certificate.
    builder
        .with_single_cert(loaded.chain.clone(), loaded.key.clone_key())
        .map_err(|e| tls_err(flags.key_file, files.key_file.as_deref().unwrap_or(Path::new("")), e))
}

/// The client listeners' TLS configuration (`None` without `--cert-file`), built here so that
/// every problem is a startup error with the flag and path in it. The listeners run the
/// handshakes themselves (`listener.rs`): tonic's own TLS knows no CRLs, versions, cipher
/// suites or allowed names.
pub fn client_listener_tls(files: &TlsFiles) -> Result<Option<Arc<ServerConfig>>, ConfigError> {
    let flags = CLIENT_TLS_FLAGS;
    let Some(loaded) = load(files, flags)? else { return Ok(None) };
    let mut config = server_config(files, flags, &loaded)?;
    // gRPC runs over HTTP/2 only.
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Some(Arc::new(config)))
}

/// Peer links' TLS: an acceptor for https peer listeners and a connector for dialling
/// members whose peer URL is https. Cheap to clone; empty when no peer TLS is configured.
#[derive(Clone, Default)]
pub struct PeerTls {
    acceptor: Option<TlsAcceptor>,
    connector: Option<TlsConnector>,
}

impl std::fmt::Debug for PeerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerTls")
            .field("accepts", &self.acceptor.is_some())
            .field("dials", &self.connector.is_some())
            .finish()
    }
}

impl PeerTls {
    /// Reads the `--peer-*` files. The dialling side verifies the other member's certificate
    /// against `--peer-trusted-ca-file` and presents its own `--peer-cert-file`.
    pub fn load(files: &TlsFiles) -> Result<PeerTls, ConfigError> {
        let flags = PEER_TLS_FLAGS;
        let Some(loaded) = load(files, flags)? else { return Ok(PeerTls::default()) };
        let acceptor = TlsAcceptor::from(Arc::new(server_config(files, flags, &loaded)?));
        let cert_path = files.cert_file.as_deref().unwrap_or(Path::new(""));
        let key_path = files.key_file.as_deref().unwrap_or(Path::new(""));
        let builder = || {
            ClientConfig::builder_with_provider(provider_for(files)?)
                .with_protocol_versions(versions(files))
                .map_err(|e| tls_err(flags.cert_file, cert_path, e))
        };
        let config = match &loaded.roots {
            Some((_, roots)) => Some(builder()?.with_root_certificates(Arc::clone(roots))),
            None if files.insecure_skip_verify => Some(
                builder()?
                    .dangerous()
                    .with_custom_certificate_verifier(Arc::new(AnyServerCert(Arc::new(ring::default_provider())))),
            ),
            None => None,
        };
        let connector = match config {
            Some(config) => {
                let config = config
                    .with_client_auth_cert(loaded.chain.clone(), loaded.key.clone_key())
                    .map_err(|e| tls_err(flags.key_file, key_path, e))?;
                Some(TlsConnector::from(Arc::new(config)))
            }
            None => None,
        };
        Ok(PeerTls { acceptor: Some(acceptor), connector })
    }

    /// Completes an accepted peer connection: TLS (bounded by [`HANDSHAKE_TIMEOUT`]) when
    /// the listener's URL is https (or unixs), the plain socket otherwise.
    pub async fn accept(&self, stream: RawPeer, https: bool) -> io::Result<PeerStream> {
        if let RawPeer::Tcp(s) = &stream {
            s.set_nodelay(true)?;
        }
        if !https {
            return Ok(stream.plain());
        }
        let Some(acceptor) = &self.acceptor else {
            return Err(io::Error::other("https peer listener without --peer-cert-file"));
        };
        Ok(match stream {
            RawPeer::Tcp(s) => PeerStream::Tls(Box::new(handshake(acceptor.accept(s), "").await?.into())),
            RawPeer::Unix(s) => PeerStream::UnixTls(Box::new(handshake(acceptor.accept(s), "").await?.into())),
        })
    }

    /// Dials a member's peer URL: TLS (bounded by [`HANDSHAKE_TIMEOUT`], the server's
    /// certificate checked against the URL's host) for https and unixs, plain TCP for http and
    /// a plain Unix socket for unix (its file is the URL's `host:port` part, as etcd names it).
    pub async fn connect(&self, url: &str) -> io::Result<PeerStream> {
        let addr = url_addr(url);
        let unix = is_unix(url);
        let raw = if unix {
            RawPeer::Unix(UnixStream::connect(&addr).await?)
        } else {
            let stream = TcpStream::connect(&addr).await?;
            stream.set_nodelay(true)?;
            RawPeer::Tcp(stream)
        };
        if !is_https(url) {
            return Ok(raw.plain());
        }
        let Some(connector) = &self.connector else {
            return Err(io::Error::other(format!(
                "peer URL {url} is https but this member has no --peer-cert-file and --peer-trusted-ca-file"
            )));
        };
        let host = addr.rsplit_once(':').map_or(addr.as_str(), |(h, _)| h);
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let name = ServerName::try_from(host.to_string())
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, format!("peer URL {url}: {e}")))?;
        let with = format!("with {url} ");
        Ok(match raw {
            RawPeer::Tcp(s) => PeerStream::Tls(Box::new(handshake(connector.connect(name, s), &with).await?.into())),
            RawPeer::Unix(s) => {
                PeerStream::UnixTls(Box::new(handshake(connector.connect(name, s), &with).await?.into()))
            }
        })
    }
}

/// The server-certificate check of `--peer-auto-tls` links: any certificate is accepted (no CA
/// signs a self-signed one), but the handshake's signatures are still verified, so the link is
/// encrypted to whoever holds the presented certificate's key. etcd dials these links the same
/// way (`InsecureSkipVerify`).
#[derive(Debug)]
struct AnyServerCert(Arc<CryptoProvider>);

impl ServerCertVerifier for AnyServerCert {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, tokio_rustls::rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, tokio_rustls::rustls::Error> {
        verify_tls12_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, tokio_rustls::rustls::Error> {
        verify_tls13_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// etcd's `--auto-tls`/`--peer-auto-tls`: `cert.pem` and `key.pem` in `dir` (etcd's
/// `<data-dir>/fixtures/client` and `/peer`), a self-signed certificate valid for the hosts of
/// `urls` (IP addresses and DNS names) for `validity_years` from now. Like etcd, an existing
/// pair in `dir` is reused, so a restarted member keeps its certificate. `flag` names the flag
/// in errors.
pub fn self_signed(
    flag: &'static str,
    dir: &Path,
    urls: &[String],
    validity_years: u32,
) -> Result<(PathBuf, PathBuf), ConfigError> {
    let cert_path = dir.join("cert.pem");
    let key_path = dir.join("key.pem");
    if cert_path.is_file() && key_path.is_file() {
        return Ok((cert_path, key_path));
    }
    let fail = |why: String| ConfigError::Tls { flag, path: dir.display().to_string(), why };
    let mut hosts: Vec<String> = Vec::new();
    for url in urls {
        let addr = url_addr(url);
        let host = addr.rsplit_once(':').map_or(addr.as_str(), |(h, _)| h);
        let host = host.trim_start_matches('[').trim_end_matches(']').to_string();
        if !hosts.contains(&host) {
            hosts.push(host);
        }
    }
    let mut params = rcgen::CertificateParams::new(hosts).map_err(|e| fail(format!("host names: {e}")))?;
    let since_epoch = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_err(|e| fail(format!("the clock is before 1970: {e}")))?;
    params.not_before = rcgen::date_time_ymd(1970, 1, 1) + since_epoch;
    params.not_after = params.not_before + Duration::from_secs(u64::from(validity_years.max(1)) * 365 * 86_400);
    params.distinguished_name.push(rcgen::DnType::OrganizationName, "KeelDB (etcd auto TLS)");
    let key = rcgen::KeyPair::generate().map_err(|e| fail(format!("key: {e}")))?;
    let cert = params.self_signed(&key).map_err(|e| fail(format!("certificate: {e}")))?;
    std::fs::create_dir_all(dir).map_err(|e| fail(format!("cannot create: {e}")))?;
    // The key is written first and readable by its owner only, then the certificate: a crash
    // between the two leaves no certificate, so the next start makes a new pair.
    write_private(&key_path, key.serialize_pem().as_bytes()).map_err(|e| fail(format!("key.pem: {e}")))?;
    std::fs::write(&cert_path, cert.pem()).map_err(|e| fail(format!("cert.pem: {e}")))?;
    Ok((cert_path, key_path))
}

fn write_private(path: &Path, bytes: &[u8]) -> io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(path)?;
    file.write_all(bytes)?;
    file.sync_all()
}

/// A peer connection, plain or TLS, over TCP or a Unix socket.
pub enum PeerStream {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::TlsStream<TcpStream>>),
    Unix(UnixStream),
    UnixTls(Box<tokio_rustls::TlsStream<UnixStream>>),
}

/// An accepted peer socket before its handshake.
pub enum RawPeer {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl RawPeer {
    /// The socket as a connection without TLS.
    fn plain(self) -> PeerStream {
        match self {
            RawPeer::Tcp(s) => PeerStream::Plain(s),
            RawPeer::Unix(s) => PeerStream::Unix(s),
        }
    }
}

/// A TLS handshake (either side, either socket), bounded by [`HANDSHAKE_TIMEOUT`]; `with`
/// names the other side in the error ("with URL " or empty).
async fn handshake<T>(tls: impl std::future::Future<Output = io::Result<T>>, with: &str) -> io::Result<T> {
    tokio::time::timeout(HANDSHAKE_TIMEOUT, tls)
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "peer TLS handshake timed out"))?
        .map_err(|e| io::Error::new(e.kind(), format!("peer TLS handshake {with}failed: {e}")))
}

/// A bound peer listener: TCP for http/https URLs, a Unix socket for unix/unixs URLs.
pub enum PeerListener {
    Tcp(TcpListener),
    Unix(UnixListener),
}

impl PeerListener {
    /// Binds a listen-peer URL. A Unix socket file left by an earlier run is replaced, as etcd
    /// does (its name is the URL's `host:port` part, relative to the working directory).
    pub async fn bind(url: &str) -> io::Result<PeerListener> {
        let addr = url_addr(url);
        if is_unix(url) {
            let path = Path::new(&addr);
            if path.exists() {
                let _ = std::fs::remove_file(path);
            }
            return Ok(PeerListener::Unix(UnixListener::bind(path)?));
        }
        Ok(PeerListener::Tcp(TcpListener::bind(&addr).await?))
    }

    /// The next connection.
    pub async fn accept(&self) -> io::Result<RawPeer> {
        match self {
            PeerListener::Tcp(l) => Ok(RawPeer::Tcp(l.accept().await?.0)),
            PeerListener::Unix(l) => Ok(RawPeer::Unix(l.accept().await?.0)),
        }
    }
}

/// `$body` with `$s` bound to the stream inside whichever variant `$stream` is.
macro_rules! each_stream {
    ($stream:expr, $s:ident => $body:expr) => {
        match $stream {
            PeerStream::Plain($s) => $body,
            PeerStream::Tls($s) => {
                let $s = $s.as_mut();
                $body
            }
            PeerStream::Unix($s) => $body,
            PeerStream::UnixTls($s) => {
                let $s = $s.as_mut();
                $body
            }
        }
    };
}

impl AsyncRead for PeerStream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        each_stream!(self.get_mut(), s => Pin::new(s).poll_read(cx, buf))
    }
}

impl AsyncWrite for PeerStream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        each_stream!(self.get_mut(), s => Pin::new(s).poll_write(cx, buf))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        each_stream!(self.get_mut(), s => Pin::new(s).poll_write_vectored(cx, bufs))
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            PeerStream::Plain(s) => s.is_write_vectored(),
            PeerStream::Tls(s) => s.is_write_vectored(),
            PeerStream::Unix(s) => s.is_write_vectored(),
            PeerStream::UnixTls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        each_stream!(self.get_mut(), s => Pin::new(s).poll_flush(cx))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        each_stream!(self.get_mut(), s => Pin::new(s).poll_shutdown(cx))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A certificate with this common name and these SANs, as DER.
    fn cert(cn: &str, sans: &[&str]) -> Vec<u8> {
        let mut params = rcgen::CertificateParams::new(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap();
        params.distinguished_name.push(rcgen::DnType::CommonName, cn);
        let key = rcgen::KeyPair::generate().unwrap();
        params.self_signed(&key).unwrap().der().to_vec()
    }

    /// etcd's test fixture `CommonName-root.crt`: one self-signed CA certificate as the trusted
    /// CA, the server's certificate and the client's. Go takes it; webpki alone refuses a CA
    /// certificate as the client's.
    #[test]
    fn a_trusted_certificate_is_accepted_as_the_client_itself() {
        let mut params = rcgen::CertificateParams::new(vec!["localhost".to_string()]).unwrap();
        params.distinguished_name.push(rcgen::DnType::CommonName, "root");
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let key = rcgen::KeyPair::generate().unwrap();
        let der = CertificateDer::from(params.self_signed(&key).unwrap().der().to_vec());
        let mut roots = RootCertStore::empty();
        roots.add(der.clone()).unwrap();
        let inner = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), Arc::new(ring::default_provider()))
            .build()
            .unwrap();
        let now = UnixTime::now();
        let plain =
            AllowedNames { inner: Arc::clone(&inner), cns: Vec::new(), hostnames: Vec::new(), anchors: Vec::new() };
        assert!(plain.verify_client_cert(&der, &[], now).is_err(), "webpki alone refuses it");
        let verifier = AllowedNames { inner, cns: Vec::new(), hostnames: Vec::new(), anchors: vec![der.clone()] };
        assert!(verifier.verify_client_cert(&der, &[], now).is_ok());
        // Only while it is valid (rcgen makes it valid until 4096).
        let later = UnixTime::since_unix_epoch(std::time::Duration::from_secs(100_000_000_000));
        assert!(verifier.verify_client_cert(&der, &[], later).is_err());
        // Another self-signed certificate is not trusted for being a CA.
        let other = CertificateDer::from(cert("root", &["localhost"]));
        assert!(verifier.verify_client_cert(&other, &[], now).is_err());
    }

    fn allowed(cns: &[&str], hostnames: &[&str]) -> AllowedNames {
        AllowedNames {
            inner: Arc::new(tokio_rustls::rustls::server::NoClientAuth),
            cns: cns.iter().map(|s| s.to_string()).collect(),
            hostnames: hostnames.iter().map(|s| s.to_string()).collect(),
            anchors: Vec::new(),
        }
    }

    #[test]
    fn allowed_names_admit_only_the_listed_common_names_or_hosts() {
        let member = cert("member-1", &["m1.example.com", "127.0.0.7"]);
        assert!(allowed(&["member-1", "member-2"], &[]).admits(&member));
        assert!(!allowed(&["member-2"], &[]).admits(&member));
        assert!(allowed(&[], &["m1.example.com"]).admits(&member));
        assert!(allowed(&[], &["127.0.0.7"]).admits(&member));
        assert!(!allowed(&[], &["127.0.0.8", "m2.example.com"]).admits(&member));
        let wildcard = cert("w", &["*.example.com"]);
        assert!(allowed(&[], &["m9.example.com"]).admits(&wildcard));
        assert!(!allowed(&[], &["a.b.example.com"]).admits(&wildcard));
        assert!(!allowed(&["x"], &[]).admits(b"not a certificate"));
    }

    #[test]
    fn cipher_suites_take_go_names_and_refuse_unknown_ones() {
        let files =
            TlsFiles { cipher_suites: vec!["TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256".into()], ..TlsFiles::default() };
        let p = provider_for(&files).unwrap();
        let tls12: Vec<_> = p.cipher_suites.iter().filter(|s| s.tls13().is_none()).collect();
        assert_eq!(tls12.len(), 1);
        assert!(p.cipher_suites.iter().any(|s| s.tls13().is_some()), "TLS 1.3 suites stay");
        let legacy =
            TlsFiles { cipher_suites: vec!["TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305".into()], ..TlsFiles::default() };
        assert!(provider_for(&legacy).is_ok(), "Go's older ChaCha20 name is taken too");
        let bad = TlsFiles { cipher_suites: vec!["TLS_RSA_WITH_RC4_128_SHA".into()], ..TlsFiles::default() };
        assert!(matches!(provider_for(&bad), Err(ConfigError::Invalid { flag: "--cipher-suites", .. })));
    }
}
