//! Zero-copy serving: blob bytes already on disk go from the page cache to the client's
//! socket with `sendfile(2)` instead of being read into user space and written back.
//!
//! hyper owns the HTTP/1.1 framing and only ever hands the transport byte slices, so
//! the body of a zero-copy response is made of *placeholders*: slices of one shared
//! buffer that nobody reads or writes. For each placeholder chunk the body queues a
//! [`Span`] (file, offset, length) on the connection's [`Sink`]; when hyper asks
//! [`ZeroCopyIo`] to write a slice that lies inside the placeholder buffer, the
//! transport sends the front span's file bytes instead.
//!
//! Invariants:
//! - hyper writes body chunks in the order the body yields them and, with a transport
//!   that reports vectored writes, queues them without copying; so the slice being
//!   written always corresponds to the front span, at the offset it records. Any
//!   disagreement (offset, length, no span queued) is an I/O error: hyper drops the
//!   connection and the client sees a short body, never wrong bytes.
//! - A span holds its own `Arc<File>`: garbage collection may unlink the blob while it
//!   is being sent and the open handle still reads the right bytes.
//! - Only HTTP/1.1 connections get a [`Sink`]; HTTP/2 copies bodies into frames and
//!   would send the placeholder's zeros.

use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};
use tokio::net::TcpStream;

/// Largest body chunk that stands for file bytes. Large enough that one `sendfile`
/// call can fill the socket buffer, small enough that hyper polls the body often.
pub(crate) const SPAN_MAX: usize = 4 << 20;

/// The placeholder buffer. Allocated zeroed and never touched, so it costs address
/// space, not memory.
fn placeholder() -> &'static Bytes {
    static PLACEHOLDER: OnceLock<Bytes> = OnceLock::new();
    PLACEHOLDER.get_or_init(|| Bytes::from(vec![0u8; SPAN_MAX]))
}

/// Where `buf` starts inside the placeholder, if it is a placeholder slice.
fn placeholder_offset(buf: &[u8]) -> Option<usize> {
    let base = placeholder().as_ptr() as usize;
    let at = buf.as_ptr() as usize;
    (!buf.is_empty() && at >= base && at < base + SPAN_MAX).then(|| at - base)
}

struct Span {
    file: Arc<File>,
    offset: u64,
    len: usize,
    sent: usize,
    /// Dropped when the span's last byte is in the socket (or the connection dies):
    /// e.g. an upload slot that must cover the whole transfer.
    _until_sent: Option<Box<dyn Send>>,
}

/// A connection's queue of file spans whose placeholders are in hyper's hands.
#[derive(Clone, Default)]
pub struct Sink(Arc<Mutex<VecDeque<Span>>>);

impl Sink {
    /// The body chunk that makes the connection send `len` bytes of `file` at `offset`.
    /// Must be yielded by the response body right away, in order.
    pub(crate) fn chunk(&self, file: Arc<File>, offset: u64, len: usize) -> Bytes {
        self.chunk_holding(file, offset, len, None)
    }

    fn chunk_holding(
        &self,
        file: Arc<File>,
        offset: u64,
        len: usize,
        until_sent: Option<Box<dyn Send>>,
    ) -> Bytes {
        let len = len.min(SPAN_MAX);
        self.0.lock().push_back(Span {
            file,
            offset,
            len,
            sent: 0,
            _until_sent: until_sent,
        });
        placeholder().slice(..len)
    }

    /// Body chunks for `[start, end)` of `file`, each at most [`SPAN_MAX`] long,
    /// queued lazily as the body is polled.
    pub(crate) fn stream_file(
        &self,
        file: Arc<File>,
        start: u64,
        end: u64,
    ) -> impl futures::Stream<Item = Bytes> + Send + 'static {
        self.stream_file_holding(file, start, end, None)
    }

    /// [`Sink::stream_file`] that keeps `until_sent` alive until the last byte has
    /// been handed to the socket.
    pub(crate) fn stream_file_holding(
        &self,
        file: Arc<File>,
        start: u64,
        end: u64,
        until_sent: Option<Box<dyn Send>>,
    ) -> impl futures::Stream<Item = Bytes> + Send + 'static {
        let sink = self.clone();
        futures::stream::unfold((start, until_sent), move |(pos, mut guard)| {
            let next = (pos < end).then(|| {
                let len = ((end - pos) as usize).min(SPAN_MAX);
                let last = pos + len as u64 >= end;
                let g = if last { guard.take() } else { None };
                (
                    sink.chunk_holding(file.clone(), pos, len, g),
                    (pos + len as u64, guard),
                )
            });
            futures::future::ready(next)
        })
    }

    #[cfg(test)]
    fn queued(&self) -> usize {
        self.0.lock().len()
    }
}

/// A TCP stream that turns placeholder slices into `sendfile` calls.
pub(crate) struct ZeroCopyIo {
    tcp: TcpStream,
    sink: Sink,
}

impl ZeroCopyIo {
    pub(crate) fn new(tcp: TcpStream, sink: Sink) -> Self {
        Self { tcp, sink }
    }

    fn poll_sendfile(
        &mut self,
        cx: &mut Context<'_>,
        at: usize,
        avail: usize,
    ) -> Poll<io::Result<usize>> {
        let (file, pos, count) = {
            let q = self.sink.0.lock();
            let Some(span) = q.front() else {
                return Poll::Ready(Err(mismatch("a placeholder arrived with no span queued")));
            };
            if span.sent != at || avail > span.len - span.sent {
                return Poll::Ready(Err(mismatch("placeholder and queued span disagree")));
            }
            (span.file.clone(), span.offset + span.sent as u64, avail)
        };
        loop {
            ready!(self.tcp.poll_write_ready(cx))?;
            let sent = self.tcp.try_io(Interest::WRITABLE, || {
                let mut offset = pos;
                rustix::fs::sendfile(&self.tcp, &*file, Some(&mut offset), count)
                    .map_err(io::Error::from)
            });
            match sent {
                Ok(0) => {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "cached file ended before the bytes it must hold",
                    )))
                }
                Ok(n) => {
                    let mut q = self.sink.0.lock();
                    if let Some(span) = q.front_mut() {
                        span.sent += n;
                        if span.sent >= span.len {
                            q.pop_front();
                        }
                    }
                    return Poll::Ready(Ok(n));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

fn mismatch(what: &str) -> io::Error {
    io::Error::other(format!("zero-copy send aborted: {what}"))
}

impl AsyncRead for ZeroCopyIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_read(cx, buf)
    }
}

impl AsyncWrite for ZeroCopyIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        match placeholder_offset(buf) {
            Some(at) => this.poll_sendfile(cx, at, buf.len()),
            None => Pin::new(&mut this.tcp).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let Some(first) = bufs.iter().position(|b| !b.is_empty()) else {
            return Poll::Ready(Ok(0));
        };
        let bufs = &bufs[first..];
        if let Some(at) = placeholder_offset(&bufs[0]) {
            return this.poll_sendfile(cx, at, bufs[0].len());
        }
        // Plain bytes (headers, multipart separators) up to the next placeholder.
        let plain = bufs
            .iter()
            .take_while(|b| placeholder_offset(b).is_none())
            .count();
        Pin::new(&mut this.tcp).poll_write_vectored(cx, &bufs[..plain])
    }

    fn is_write_vectored(&self) -> bool {
        // hyper copies every chunk into one buffer for transports without vectored
        // writes; that would send the placeholder itself.
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;
    use std::io::Write;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn temp_file(bytes: &[u8]) -> Arc<File> {
        let mut f = tempfile::tempfile().expect("tempfile");
        f.write_all(bytes).expect("write");
        Arc::new(f)
    }

    async fn pair() -> (TcpStream, TcpStream) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = l.local_addr().expect("addr");
        let (a, b) = tokio::join!(TcpStream::connect(addr), l.accept());
        (a.expect("connect"), b.expect("accept").0)
    }

    #[tokio::test]
    async fn placeholders_become_file_bytes_between_plain_bytes() {
        let content: Vec<u8> = (0..(SPAN_MAX * 2 + 12345))
            .map(|i| (i * 7 % 251) as u8)
            .collect();
        let file = temp_file(&content);
        let (server, mut client) = pair().await;
        let sink = Sink::default();
        let mut io = ZeroCopyIo::new(server, sink.clone());
        let start = 1000u64;
        let end = content.len() as u64 - 10;
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            client.read_to_end(&mut got).await.expect("read");
            got
        });
        io.write_all(b"head:").await.expect("plain");
        let chunks: Vec<Bytes> = sink.stream_file(file.clone(), start, end).collect().await;
        assert_eq!(chunks.len(), 3);
        for c in &chunks {
            // Vectored write mixing a plain slice and a placeholder, like hyper does.
            let mut done = 0;
            while done < c.len() {
                let n = io
                    .write_vectored(&[io::IoSlice::new(&c[done..])])
                    .await
                    .expect("sendfile");
                done += n;
            }
        }
        io.write_all(b":tail").await.expect("plain");
        assert_eq!(sink.queued(), 0);
        io.shutdown().await.expect("shutdown");
        drop(io);
        let got = reader.await.expect("join");
        let mut want = b"head:".to_vec();
        want.extend_from_slice(&content[start as usize..end as usize]);
        want.extend_from_slice(b":tail");
        assert_eq!(got.len(), want.len());
        assert!(got == want, "bytes differ");
    }

    #[tokio::test]
    async fn a_guard_lives_until_the_last_byte_is_sent() {
        let file = temp_file(&[3u8; 1000]);
        let (server, mut client) = pair().await;
        let sink = Sink::default();
        let mut io = ZeroCopyIo::new(server, sink.clone());
        let guard = Arc::new(());
        let chunks: Vec<Bytes> = sink
            .stream_file_holding(file, 0, 1000, Some(Box::new(guard.clone())))
            .collect()
            .await;
        assert_eq!(
            Arc::strong_count(&guard),
            2,
            "held while the bytes are queued"
        );
        let n = io.write(&chunks[0][..400]).await.expect("send");
        assert_eq!(n, 400);
        assert_eq!(Arc::strong_count(&guard), 2, "held while bytes remain");
        io.write_all(&chunks[0][400..]).await.expect("send");
        assert_eq!(Arc::strong_count(&guard), 1, "released with the last byte");
        let mut got = vec![0u8; 1000];
        client.read_exact(&mut got).await.expect("read");
        assert!(got.iter().all(|&b| b == 3));
    }

    #[tokio::test]
    async fn a_placeholder_without_its_span_is_an_error_not_zeros() {
        let (server, _client) = pair().await;
        let sink = Sink::default();
        let mut io = ZeroCopyIo::new(server, sink.clone());
        let stray = placeholder().slice(..100);
        let e = io.write(&stray).await.expect_err("must refuse");
        assert!(e.to_string().contains("zero-copy"), "{e}");
        // Out of order: a span queued at offset 0 but the slice says offset 10.
        let file = temp_file(&[1u8; 100]);
        let chunk = sink.chunk(file, 0, 100);
        let e = io.write(&chunk[10..]).await.expect_err("must refuse");
        assert!(e.to_string().contains("disagree"), "{e}");
    }

    #[tokio::test]
    async fn a_file_shorter_than_its_span_is_an_error() {
        let (server, _client) = pair().await;
        let sink = Sink::default();
        let mut io = ZeroCopyIo::new(server, sink.clone());
        let file = temp_file(&[9u8; 10]);
        let chunk = sink.chunk(file, 0, 100);
        let n = io.write(&chunk[..]).await.expect("the 10 bytes that exist");
        assert_eq!(n, 10);
        let e = io.write(&chunk[n..]).await.expect_err("EOF");
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
    }
}
