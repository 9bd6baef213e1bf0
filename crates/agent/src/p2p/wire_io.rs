//! Frames over a peer connection (plain TCP, or mutual TLS when the agent has a node
//! certificate): reading frames and the raw bytes after a `Data` header, writing
//! frames, and sending file bytes — with `sendfile(2)` on plain TCP (page cache to
//! socket, no copy through user space), through a buffer under TLS (the kernel cannot
//! encrypt for us).

use std::fs::File;
use std::io;
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use swarm::wire::Frame;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::TcpStream;

use crate::Error;

/// Bytes per `Data` frame: small enough that control frames (HAVE) wait at most this
/// long behind a piece on the same connection, large enough that per-frame costs
/// (a header, a token-bucket reservation, one `sendfile`) vanish.
pub(crate) const DATA_CHUNK: u64 = 512 << 10;

/// How long a handshake may take.
pub(crate) const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// A holder's write that has not gone through after this long ends the connection:
/// the downloader stopped reading (frozen, crashed, its link gone), and TCP would keep
/// the upload slot for as long as the peer's kernel answers with a zero window, or a
/// quarter of an hour of retransmits for a dead node. Generous, because a live
/// downloader may read slowly on purpose (a prewarm's rate limit shared by many
/// holders): one 512 KiB `Data` chunk in 20 s is 25 KiB/s, and 20 s is also how long a
/// pull client waits for data before it asks again.
pub(crate) const SEND_STALL: Duration = Duration::from_secs(20);

/// `write` (one frame batch or chunk to `peer`), given up after [`SEND_STALL`] and
/// counted in `stalled`.
pub(crate) async fn before_send_stall<T>(
    stalled: &prometheus_client::metrics::counter::Counter,
    peer: &str,
    write: impl std::future::Future<Output = Result<T, Error>>,
) -> Result<T, Error> {
    tokio::time::timeout(SEND_STALL, write).await.map_err(|_| {
        stalled.inc();
        tracing::warn!(%peer, "peer stopped reading; connection closed");
        peer_err(
            peer,
            format!("stopped reading: nothing went through for {SEND_STALL:?}"),
        )
    })?
}

pub(crate) fn peer_err(peer: &str, message: impl std::fmt::Display) -> Error {
    Error::Peer {
        peer: peer.to_owned(),
        message: message.to_string(),
    }
}

/// The most a frame read takes from the stream at once. The bytes after a `Data`
/// header are read straight into the piece's buffer ([`FrameReader::read_payload`]);
/// whatever a frame read took of them is copied over a second time. Unbounded (up to
/// the buffer's 64 KiB), that was up to one payload byte in eight and 1–2 % of the
/// agents' CPU at 4 × 100 MiB/s and in the demo (BENCHMARKS.md, issue 11, twenty-fifth session); a
/// few KiB still hold a burst of a hundred HAVEs.
const FRAME_READ_AHEAD: u64 = 8 << 10;

/// Reads frames from a stream, with a buffer for what arrives ahead of them.
pub(crate) struct FrameReader<R> {
    inner: R,
    buf: BytesMut,
    peer: String,
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    pub(crate) fn new(inner: R, peer: &str) -> Self {
        Self {
            inner,
            buf: BytesMut::with_capacity(64 << 10),
            peer: peer.to_owned(),
        }
    }

    pub(crate) fn set_peer(&mut self, peer: &str) {
        self.peer = peer.to_owned();
    }

    /// The next frame; `None` at a clean end of stream between frames.
    pub(crate) async fn next(&mut self) -> Result<Option<Frame>, Error> {
        loop {
            match Frame::decode(&mut self.buf) {
                Ok(Some(f)) => return Ok(Some(f)),
                Ok(None) => {}
                Err(e) => return Err(peer_err(&self.peer, e)),
            }
            if self.buf.capacity() - self.buf.len() < 16 << 10 {
                self.buf.reserve(64 << 10);
            }
            let n = (&mut self.inner)
                .take(FRAME_READ_AHEAD)
                .read_buf(&mut self.buf)
                .await
                .map_err(|e| peer_err(&self.peer, e))?;
            if n == 0 {
                return if self.buf.is_empty() {
                    Ok(None)
                } else {
                    Err(peer_err(&self.peer, "connection closed mid-frame"))
                };
            }
        }
    }

    /// Fills `out` with the raw bytes that follow a `Data` header.
    pub(crate) async fn read_payload(&mut self, out: &mut [u8]) -> Result<(), Error> {
        let have = self.buf.len().min(out.len());
        out[..have].copy_from_slice(&self.buf[..have]);
        let _ = self.buf.split_to(have);
        if have < out.len() {
            self.inner
                .read_exact(&mut out[have..])
                .await
                .map_err(|e| peer_err(&self.peer, e))?;
        }
        Ok(())
    }

    /// Reads and drops `n` payload bytes (a piece nobody wants any more).
    pub(crate) async fn skip_payload(&mut self, mut n: usize) -> Result<(), Error> {
        let have = self.buf.len().min(n);
        let _ = self.buf.split_to(have);
        n -= have;
        let mut scratch = vec![0u8; n.min(64 << 10)];
        while n > 0 {
            let k = n.min(scratch.len());
            self.inner
                .read_exact(&mut scratch[..k])
                .await
                .map_err(|e| peer_err(&self.peer, e))?;
            n -= k;
        }
        Ok(())
    }
}

/// The read side of a peer connection.
pub(crate) type PeerRead = Box<dyn AsyncRead + Send + Unpin>;

/// The write side of a peer connection.
pub(crate) enum PeerWrite {
    /// Plain TCP: file bytes go out with `sendfile`.
    Tcp(OwnedWriteHalf),
    /// TLS (client or server side): every byte goes through rustls.
    Tls(Box<dyn AsyncWrite + Send + Unpin>),
}

impl PeerWrite {
    /// Writes all of `buf` and, under TLS, flushes the records out: frames must not sit
    /// in a buffer while the peer waits for them.
    pub(crate) async fn send(&mut self, buf: &[u8]) -> io::Result<()> {
        match self {
            PeerWrite::Tcp(w) => w.write_all(buf).await,
            PeerWrite::Tls(w) => {
                w.write_all(buf).await?;
                w.flush().await
            }
        }
    }
}

/// Splits a plain TCP connection.
pub(crate) fn split_tcp(tcp: TcpStream) -> (PeerRead, PeerWrite) {
    let (r, w) = tcp.into_split();
    (Box::new(r), PeerWrite::Tcp(w))
}

/// Splits a TLS connection (either side).
pub(crate) fn split_tls<S>(stream: S) -> (PeerRead, PeerWrite)
where
    S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let (r, w) = tokio::io::split(stream);
    (Box::new(r), PeerWrite::Tls(Box::new(w)))
}

pub(crate) async fn write_frames(
    w: &mut PeerWrite,
    frames: &[Frame],
    peer: &str,
) -> Result<(), Error> {
    let mut out = BytesMut::new();
    for f in frames {
        f.encode(&mut out);
    }
    w.send(&out).await.map_err(|e| peer_err(peer, e))
}

/// Sends `len` bytes of `file` at `offset` on the connection behind `w`.
pub(crate) async fn send_file(
    w: &mut PeerWrite,
    file: &Arc<File>,
    offset: u64,
    len: u64,
    peer: &str,
) -> Result<(), Error> {
    match w {
        PeerWrite::Tcp(w) => sendfile(w, file, offset, len, peer).await,
        PeerWrite::Tls(_) => {
            use std::os::unix::fs::FileExt;
            // Pieces are read right after they were written or served before: the
            // page cache answers, as for the corrupting test path.
            let mut buf = vec![0u8; len.min(DATA_CHUNK) as usize];
            let mut done = 0u64;
            while done < len {
                let n = (len - done).min(buf.len() as u64) as usize;
                file.read_exact_at(&mut buf[..n], offset + done)
                    .map_err(|e| peer_err(peer, format!("blob file: {e}")))?;
                w.send(&buf[..n]).await.map_err(|e| peer_err(peer, e))?;
                done += n as u64;
            }
            Ok(())
        }
    }
}

async fn sendfile(
    w: &OwnedWriteHalf,
    file: &Arc<File>,
    mut offset: u64,
    len: u64,
    peer: &str,
) -> Result<(), Error> {
    let tcp: &TcpStream = w.as_ref();
    let end = offset + len;
    while offset < end {
        tcp.writable().await.map_err(|e| peer_err(peer, e))?;
        let want = (end - offset) as usize;
        let sent = tcp.try_io(tokio::io::Interest::WRITABLE, || {
            let mut at = offset;
            rustix::fs::sendfile(tcp, &**file, Some(&mut at), want).map_err(io::Error::from)
        });
        match sent {
            Ok(0) => {
                return Err(peer_err(
                    peer,
                    "blob file ended before the bytes it must hold",
                ))
            }
            Ok(n) => offset += n as u64,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(peer_err(peer, e)),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(f: Frame) -> BytesMut {
        let mut out = BytesMut::new();
        f.encode(&mut out);
        out
    }

    #[tokio::test]
    async fn a_data_header_leaves_at_most_the_read_ahead_of_its_payload_buffered() {
        let payload: Vec<u8> = (0..DATA_CHUNK as u32).map(|i| (i % 251) as u8).collect();
        let mut stream = frame(Frame::Data {
            chan: 3,
            piece: 7,
            offset: 0,
            len: payload.len() as u32,
        });
        stream.extend_from_slice(&payload);
        stream.extend_from_slice(&frame(Frame::Have {
            chan: 3,
            piece: 8,
            hash: None,
        }));
        let bytes = stream.freeze();
        let mut reader = FrameReader::new(&bytes[..], "peer");
        let Some(Frame::Data { len, .. }) = reader.next().await.expect("reads") else {
            panic!("not a Data header");
        };
        assert!(
            reader.buf.len() as u64 <= FRAME_READ_AHEAD,
            "{} payload bytes buffered ahead",
            reader.buf.len()
        );
        let mut out = vec![0u8; len as usize];
        reader.read_payload(&mut out).await.expect("payload");
        assert!(out == payload, "the payload came through changed");
        assert!(matches!(
            reader.next().await.expect("reads"),
            Some(Frame::Have {
                chan: 3,
                piece: 8,
                ..
            })
        ));
        assert!(reader.next().await.expect("clean end").is_none());
    }
}
