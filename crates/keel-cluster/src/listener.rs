//! The client listeners: binding `--listen-client-urls` (TCP, and Unix domain sockets for
//! `unix://` and `unixs://`), running TLS handshakes for https URLs with the member's rustls
//! configuration (`tls.rs`: CRLs, versions, cipher suites, allowed names), and handing each
//! ready connection to tonic with what the services need to know about it
//! ([`ClientConnInfo`]: the verified client certificate).
//!
//! One port may serve both `http://` and `https://` (as etcd): the first byte of a connection
//! decides (a TLS record starts with 0x16, an HTTP/2 preface with `P`).
//!
//! What it must not do: block the accept loop on a client (handshakes run in their own tasks,
//! bounded by [`HANDSHAKE_TIMEOUT`]), or hand tonic a connection whose TLS failed.

use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use rustls_pki_types::CertificateDer;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio::sync::mpsc;
use tokio_rustls::rustls::ServerConfig;
use tokio_rustls::TlsAcceptor;

use crate::config::{is_https, is_unix};
use crate::tls::HANDSHAKE_TIMEOUT;

/// What the services may know about the connection a request came on (a request extension).
#[derive(Debug, Clone, Default)]
pub struct ClientConnInfo {
    /// The client's address (TCP only).
    pub remote: Option<SocketAddr>,
    /// The client's certificate chain, present only when rustls verified it.
    pub peer_certs: Option<Arc<Vec<CertificateDer<'static>>>>,
}

/// A client connection, ready for gRPC.
pub enum ClientIo {
    Tcp(TcpStream),
    TcpTls(Box<tokio_rustls::server::TlsStream<TcpStream>>),
    Unix(UnixStream),
    UnixTls(Box<tokio_rustls::server::TlsStream<UnixStream>>),
}

impl tonic::transport::server::Connected for ClientIo {
    type ConnectInfo = ClientConnInfo;

    fn connect_info(&self) -> ClientConnInfo {
        let certs = |c: Option<&[CertificateDer<'static>]>| c.map(|c| Arc::new(c.to_vec()));
        match self {
            ClientIo::Tcp(s) => ClientConnInfo { remote: s.peer_addr().ok(), peer_certs: None },
            ClientIo::TcpTls(s) => {
                let (tcp, session) = s.get_ref();
                ClientConnInfo { remote: tcp.peer_addr().ok(), peer_certs: certs(session.peer_certificates()) }
            }
            ClientIo::Unix(_) => ClientConnInfo::default(),
            ClientIo::UnixTls(s) => {
                ClientConnInfo { remote: None, peer_certs: certs(s.get_ref().1.peer_certificates()) }
            }
        }
    }
}

macro_rules! each_io {
    ($self:expr, $s:ident => $e:expr) => {
        match $self.get_mut() {
            ClientIo::Tcp($s) => $e,
            ClientIo::TcpTls($s) => {
                let $s = $s.as_mut();
                $e
            }
            ClientIo::Unix($s) => $e,
            ClientIo::UnixTls($s) => {
                let $s = $s.as_mut();
                $e
            }
        }
    };
}

impl AsyncRead for ClientIo {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        each_io!(self, s => Pin::new(s).poll_read(cx, buf))
    }
}

impl AsyncWrite for ClientIo {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        each_io!(self, s => Pin::new(s).poll_write(cx, buf))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        each_io!(self, s => Pin::new(s).poll_write_vectored(cx, bufs))
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            ClientIo::Tcp(s) => s.is_write_vectored(),
            ClientIo::TcpTls(s) => s.is_write_vectored(),
            ClientIo::Unix(s) => s.is_write_vectored(),
            ClientIo::UnixTls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        each_io!(self, s => Pin::new(s).poll_flush(cx))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        each_io!(self, s => Pin::new(s).poll_shutdown(cx))
    }
}

/// Where one listener is bound.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    Tcp(SocketAddr),
    Unix(PathBuf),
}

/// One bound client listener: every URL naming the same address shares it.
pub struct Listener {
    socket: Socket,
    /// The URLs it serves (for error messages).
    pub urls: Vec<String>,
    plain: bool,
    tls: Option<TlsAcceptor>,
}

enum Socket {
    Tcp(TcpListener),
    Unix(UnixListener),
}

/// Why a client listener could not be made.
#[derive(Debug, thiserror::Error)]
pub enum ListenError {
    #[error("cannot listen on {url}: {source}")]
    Bind { url: String, source: io::Error },
    #[error("{url} is https but no --cert-file is configured")]
    NoCertificate { url: String },
}

/// The address part of a client URL: `host:port`, or a Unix socket's file name.
fn endpoint_of(url: &str) -> Result<(bool, String), ListenError> {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    Ok((is_unix(url), rest.trim_end_matches('/').to_string()))
}

/// Binds every URL of `urls` (one listener per distinct address; `http` and `https` URLs of
/// the same address share it). A Unix socket file left by an earlier run is replaced, as etcd
/// does.
pub async fn bind(urls: &[String], tls: Option<Arc<ServerConfig>>) -> Result<Vec<Listener>, ListenError> {
    let mut out: Vec<(String, bool, Listener)> = Vec::new();
    for url in urls {
        let (unix, addr) = endpoint_of(url)?;
        let https = is_https(url);
        let acceptor = match (https, &tls) {
            (true, Some(config)) => Some(TlsAcceptor::from(Arc::clone(config))),
            (true, None) => return Err(ListenError::NoCertificate { url: url.clone() }),
            (false, _) => None,
        };
        if let Some((_, _, l)) = out.iter_mut().find(|(a, u, _)| *a == addr && *u == unix) {
            l.urls.push(url.clone());
            l.plain |= !https;
            if acceptor.is_some() {
                l.tls = acceptor;
            }
            continue;
        }
        let bind_err = |source| ListenError::Bind { url: url.clone(), source };
        let socket = if unix {
            let path = PathBuf::from(&addr);
            if path.exists() {
                let _ = std::fs::remove_file(&path);
            }
            Socket::Unix(UnixListener::bind(&path).map_err(bind_err)?)
        } else {
            Socket::Tcp(TcpListener::bind(&addr).await.map_err(bind_err)?)
        };
        out.push((addr, unix, Listener { socket, urls: vec![url.clone()], plain: !https, tls: acceptor }));
    }
    Ok(out.into_iter().map(|(_, _, l)| l).collect())
}

impl Listener {
    /// Where it is bound (port 0 in a URL picks a free port: this is the one picked).
    pub fn endpoint(&self) -> io::Result<Endpoint> {
        match &self.socket {
            Socket::Tcp(l) => Ok(Endpoint::Tcp(l.local_addr()?)),
            Socket::Unix(l) => {
                let addr = l.local_addr()?;
                Ok(Endpoint::Unix(addr.as_pathname().map(PathBuf::from).unwrap_or_default()))
            }
        }
    }

    /// The connections it accepts, each past its TLS handshake when it needs one. Accepting
    /// stops when the stream is dropped.
    pub fn incoming(self) -> tokio_stream::wrappers::ReceiverStream<io::Result<ClientIo>> {
        let (tx, rx) = mpsc::channel(64);
        tokio::spawn(self.accept_loop(tx));
        tokio_stream::wrappers::ReceiverStream::new(rx)
    }

    async fn accept_loop(self, tx: mpsc::Sender<io::Result<ClientIo>>) {
        let kind = Kind { plain: self.plain, tls: self.tls.clone() };
        loop {
            let accepted = tokio::select! {
                a = accept(&self.socket) => a,
                _ = tx.closed() => return,
            };
            match accepted {
                Ok(conn) => {
                    let (tx, kind) = (tx.clone(), kind.clone());
                    tokio::spawn(async move {
                        // A failed handshake costs that connection only.
                        if let Ok(Ok(io)) = tokio::time::timeout(HANDSHAKE_TIMEOUT, kind.ready(conn)).await {
                            let _ = tx.send(Ok(io)).await;
                        }
                    });
                }
                // Out of descriptors and the like: pause instead of spinning.
                Err(_) => tokio::time::sleep(std::time::Duration::from_millis(50)).await,
            }
        }
    }
}

enum Accepted {
    Tcp(TcpStream),
    Unix(UnixStream),
}

async fn accept(socket: &Socket) -> io::Result<Accepted> {
    match socket {
        Socket::Tcp(l) => {
            let (s, _) = l.accept().await?;
            // Without TCP_NODELAY small gRPC replies wait for the peer's delayed ACK (40 ms).
            s.set_nodelay(true)?;
            Ok(Accepted::Tcp(s))
        }
        Socket::Unix(l) => Ok(Accepted::Unix(l.accept().await?.0)),
    }
}

/// What a listener speaks: plaintext, TLS, or both (decided per connection by its first byte).
#[derive(Clone)]
struct Kind {
    plain: bool,
    tls: Option<TlsAcceptor>,
}

/// The first byte of every TLS connection: a handshake record.
const TLS_HANDSHAKE_RECORD: u8 = 0x16;

impl Kind {
    async fn ready(&self, conn: Accepted) -> io::Result<ClientIo> {
        match conn {
            Accepted::Tcp(s) => {
                let tls = match (&self.tls, self.plain) {
                    (Some(_), true) => {
                        let mut first = [0u8; 1];
                        s.peek(&mut first).await? == 1 && first[0] == TLS_HANDSHAKE_RECORD
                    }
                    (Some(_), false) => true,
                    (None, _) => false,
                };
                match (&self.tls, tls) {
                    (Some(a), true) => Ok(ClientIo::TcpTls(Box::new(a.accept(s).await?))),
                    _ => Ok(ClientIo::Tcp(s)),
                }
            }
            Accepted::Unix(s) => match &self.tls {
                // A unix socket is one URL's: unixs:// is TLS, unix:// is not (no sniffing:
                // UnixStream has no peek in tokio).
                Some(a) if !self.plain => Ok(ClientIo::UnixTls(Box::new(a.accept(s).await?))),
                _ => Ok(ClientIo::Unix(s)),
            },
        }
    }
}
