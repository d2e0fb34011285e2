//! A TCP proxy on loopback that holds every chunk of bytes for a fixed time in each direction
//! (no netem in this kernel): put in front of a member's advertised client and peer URLs, it
//! gives every call to that member, and every peer message to it and its answer, the same extra
//! round trip, for any system (keel and etcd alike). Order is kept and later chunks do not wait
//! behind earlier ones' delays (a pipelined stream keeps its throughput). Threads sleep to the
//! chunk's due time, which is finer than an async timer's millisecond ticks.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A running proxy; it stops accepting when dropped (open connections end with their peers).
pub(super) struct DelayProxy {
    pub(super) addr: SocketAddr,
    stop: Arc<AtomicBool>,
}

impl Drop for DelayProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wake the accept loop.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
    }
}

impl DelayProxy {
    /// Listens on `listen` and forwards each connection to `upstream`, holding bytes `one_way`
    /// in each direction.
    pub(super) fn start(listen: SocketAddr, upstream: SocketAddr, one_way: Duration) -> std::io::Result<DelayProxy> {
        let listener = TcpListener::bind(listen)?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                if flag.load(Ordering::Relaxed) {
                    break;
                }
                let Ok(down) = conn else { continue };
                let Ok(up) = TcpStream::connect(upstream) else { continue };
                let _ = (down.set_nodelay(true), up.set_nodelay(true));
                let (Ok(down2), Ok(up2)) = (down.try_clone(), up.try_clone()) else { continue };
                pump(down, up2, one_way);
                pump(up, down2, one_way);
            }
        });
        Ok(DelayProxy { addr, stop })
    }
}

/// Copies `from` to `to`, each chunk written `delay` after it was read.
fn pump(mut from: TcpStream, mut to: TcpStream, delay: Duration) {
    let (tx, rx) = mpsc::channel::<(Instant, Vec<u8>)>();
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if tx.send((Instant::now() + delay, buf[..n].to_vec())).is_err() {
                        break;
                    }
                }
            }
        }
        let _ = from.shutdown(Shutdown::Read);
    });
    std::thread::spawn(move || {
        while let Ok((due, bytes)) = rx.recv() {
            let now = Instant::now();
            if due > now {
                std::thread::sleep(due - now);
            }
            if to.write_all(&bytes).is_err() {
                break;
            }
        }
        let _ = to.shutdown(Shutdown::Write);
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_each_direction_and_keeps_order() {
        let echo = TcpListener::bind("127.0.0.1:0").unwrap();
        let upstream = echo.local_addr().unwrap();
        std::thread::spawn(move || {
            if let Ok((mut s, _)) = echo.accept() {
                let mut buf = [0u8; 1024];
                while let Ok(n) = s.read(&mut buf) {
                    if n == 0 || s.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            }
        });
        let proxy = DelayProxy::start("127.0.0.1:0".parse().unwrap(), upstream, Duration::from_millis(20)).unwrap();
        let mut c = TcpStream::connect(proxy.addr).unwrap();
        let start = Instant::now();
        c.write_all(b"abc").unwrap();
        c.write_all(b"def").unwrap();
        let mut got = Vec::new();
        let mut buf = [0u8; 16];
        while got.len() < 6 {
            let n = c.read(&mut buf).unwrap();
            assert!(n > 0, "the proxy closed early");
            got.extend_from_slice(&buf[..n]);
        }
        let rtt = start.elapsed();
        assert_eq!(got, b"abcdef");
        assert!(rtt >= Duration::from_millis(40), "a round trip through the proxy took only {rtt:?}");
    }
}
