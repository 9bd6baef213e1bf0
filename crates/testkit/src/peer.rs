//! A raw client of the agents' peer protocol, for tests that talk to a real agent the
//! way another agent (or a hostile tenant) would: handshake, open a blob, ask for
//! pieces, read frames and bytes as they come.

use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use bytes::BytesMut;
use swarm::wire::{self, ChannelId, Frame};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

pub struct PeerClient {
    tcp: TcpStream,
    buf: BytesMut,
    /// The holder's name from its HELLO.
    pub holder: String,
}

/// What a frame read produced: a frame, or a frame plus the raw bytes after it.
#[derive(Debug)]
pub enum Read {
    Frame(Frame),
    Data {
        chan: ChannelId,
        piece: u32,
        offset: u32,
        bytes: Vec<u8>,
    },
}

impl PeerClient {
    /// Connects and runs the handshake as `me`, proving `token` (`None`: no proof).
    pub async fn connect(addr: &str, me: &str, token: Option<&str>) -> Result<Self> {
        let tcp = TcpStream::connect(addr).await.context("connect")?;
        let mut c = Self {
            tcp,
            buf: BytesMut::new(),
            holder: String::new(),
        };
        let nonce: [u8; 16] = rand::random();
        c.send(&[Frame::Hello {
            version: wire::PROTOCOL_VERSION,
            node: me.into(),
            addr: "127.0.0.1:1".into(),
            nonce,
            proof: [0; 32],
        }])
        .await?;
        let Read::Frame(Frame::Hello {
            node,
            nonce: theirs,
            proof,
            ..
        }) = c.read().await?
        else {
            bail!("expected HELLO");
        };
        if let Some(t) = token {
            let want = wire::handshake_proof(t.as_bytes(), wire::ROLE_HOLDER, &nonce, &node);
            if !wire::proofs_equal(&want, &proof) {
                bail!("the holder does not know the token");
            }
        }
        let answer = match token {
            Some(t) => wire::handshake_proof(t.as_bytes(), wire::ROLE_DIALER, &theirs, me),
            None => [0; 32],
        };
        c.send(&[Frame::Auth { proof: answer }]).await?;
        c.holder = node;
        Ok(c)
    }

    pub async fn send(&mut self, frames: &[Frame]) -> Result<()> {
        let mut out = BytesMut::new();
        for f in frames {
            f.encode(&mut out);
        }
        self.tcp.write_all(&out).await.context("send")?;
        Ok(())
    }

    /// Sends raw bytes (a malformed frame, say).
    pub async fn send_raw(&mut self, bytes: &[u8]) -> Result<()> {
        self.tcp.write_all(bytes).await.context("send raw")?;
        Ok(())
    }

    /// The next frame (with its payload for `Data`), within 30 s.
    pub async fn read(&mut self) -> Result<Read> {
        tokio::time::timeout(Duration::from_secs(30), self.read_inner())
            .await
            .map_err(|_| anyhow!("no frame within 30 s"))?
    }

    async fn read_inner(&mut self) -> Result<Read> {
        loop {
            if let Some(f) = Frame::decode(&mut self.buf)? {
                if let Frame::Data {
                    chan,
                    piece,
                    offset,
                    len,
                } = f
                {
                    let mut bytes = vec![0u8; len as usize];
                    let have = self.buf.len().min(bytes.len());
                    bytes[..have].copy_from_slice(&self.buf.split_to(have));
                    if have < bytes.len() {
                        self.tcp.read_exact(&mut bytes[have..]).await?;
                    }
                    return Ok(Read::Data {
                        chan,
                        piece,
                        offset,
                        bytes,
                    });
                }
                return Ok(Read::Frame(f));
            }
            self.buf.reserve(64 << 10);
            if self.tcp.read_buf(&mut self.buf).await? == 0 {
                bail!("connection closed");
            }
        }
    }

    /// Reads frames until a whole piece has arrived on `chan`; returns its bytes and
    /// every other frame seen meanwhile.
    pub async fn read_piece(
        &mut self,
        chan: ChannelId,
        piece: u32,
        len: usize,
    ) -> Result<(Vec<u8>, Vec<Frame>)> {
        self.read_piece_from(chan, piece, 0, len).await
    }

    /// [`PeerClient::read_piece`] for a piece whose first `from` bytes were read.
    pub async fn read_piece_from(
        &mut self,
        chan: ChannelId,
        piece: u32,
        from: usize,
        len: usize,
    ) -> Result<(Vec<u8>, Vec<Frame>)> {
        let mut out = Vec::with_capacity(len);
        let mut others = Vec::new();
        while out.len() < len {
            match self.read().await? {
                Read::Data {
                    chan: c,
                    piece: p,
                    offset,
                    bytes,
                } if c == chan && p == piece && offset as usize == from + out.len() => {
                    out.extend(bytes)
                }
                Read::Data { piece: p, .. } => bail!("unexpected data for piece {p}"),
                Read::Frame(f) => others.push(f),
            }
        }
        Ok((out, others))
    }
}

/// The raw sha256 of a digest string `sha256:<hex>`.
pub fn raw_digest(d: &str) -> [u8; 32] {
    let mut out = [0u8; 32];
    let _ = hex::decode_to_slice(d.trim_start_matches("sha256:"), &mut out);
    out
}

/// What a [`start_mute_holder`] answers to a piece request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MuteAnswer {
    /// Nothing, and no PONG either.
    Nothing,
    /// REJECT busy, every time (and PONG).
    Busy,
    /// REJECT not held, every time (and PONG), after claiming the whole blob.
    NotHeld,
}

/// A hostile holder: it completes the handshake (knowing the cluster token), says it
/// holds every blob a downloader opens, and then never sends a piece (`answer`).
/// A real agent cannot be made to do this; it stands for a tenant's modified agent.
/// Returns its address; it serves until the task is aborted.
pub async fn start_mute_holder(
    name: &str,
    token: &str,
    answer: MuteAnswer,
) -> Result<(String, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?.to_string();
    let (name, token) = (name.to_owned(), token.to_owned());
    let task = tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let (name, token) = (name.clone(), token.clone());
            tokio::spawn(async move {
                let _ = mute_connection(tcp, &name, &token, answer).await;
            });
        }
    });
    Ok((addr, task))
}

async fn mute_connection(tcp: TcpStream, me: &str, token: &str, answer: MuteAnswer) -> Result<()> {
    let mut c = PeerClient {
        tcp,
        buf: BytesMut::new(),
        holder: String::new(),
    };
    let Read::Frame(Frame::Hello { nonce: theirs, .. }) = c.read().await? else {
        bail!("expected HELLO");
    };
    let nonce: [u8; 16] = rand::random();
    c.send(&[Frame::Hello {
        version: wire::PROTOCOL_VERSION,
        node: me.into(),
        addr: String::new(),
        nonce,
        proof: wire::handshake_proof(token.as_bytes(), wire::ROLE_HOLDER, &theirs, me),
    }])
    .await?;
    loop {
        match (c.read_inner().await?, answer) {
            (Read::Frame(Frame::Open { chan, .. }), _) => {
                c.send(&[Frame::Complete { chan }]).await?;
            }
            (
                Read::Frame(Frame::Request { chan, piece, .. }),
                refusal @ (MuteAnswer::Busy | MuteAnswer::NotHeld),
            ) => {
                let reason = if refusal == MuteAnswer::Busy {
                    wire::RejectReason::Busy
                } else {
                    wire::RejectReason::NotHeld
                };
                c.send(&[Frame::Reject {
                    chan,
                    piece,
                    reason,
                }])
                .await?;
            }
            (Read::Frame(Frame::Ping { nonce }), MuteAnswer::Busy | MuteAnswer::NotHeld) => {
                c.send(&[Frame::Pong { nonce }]).await?;
            }
            _ => {}
        }
    }
}
