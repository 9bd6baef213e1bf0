//! Content digests (`sha256:<64 hex>`), the identity of every blob and manifest.

use std::fmt;
use std::str::FromStr;

use sha2::{Digest as _, Sha256};

use crate::Error;

/// A validated `sha256:` digest. Other algorithms are rejected as unsupported rather
/// than guessed at: a mirror that cannot verify content must not cache it.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest {
    hex: String,
}

impl Digest {
    pub fn parse(s: &str) -> Result<Self, Error> {
        let Some((alg, hex)) = s.split_once(':') else {
            return Err(Error::DigestInvalid(format!(
                "{s:.80}: missing algorithm prefix"
            )));
        };
        match alg {
            "sha256" => {}
            "sha384" | "sha512" => {
                return Err(Error::Unsupported(format!(
                    "digest algorithm {alg} is not supported"
                )))
            }
            _ => {
                return Err(Error::DigestInvalid(format!(
                    "unknown digest algorithm {alg:.20}"
                )))
            }
        }
        if hex.len() != 64
            || !hex
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        {
            return Err(Error::DigestInvalid(format!(
                "{s:.80}: sha256 digest must be 64 lowercase hex characters"
            )));
        }
        Ok(Self {
            hex: hex.to_owned(),
        })
    }

    pub fn of(bytes: &[u8]) -> Self {
        Self::from_sha256(Sha256::digest(bytes).into())
    }

    pub fn from_sha256(raw: [u8; 32]) -> Self {
        Self {
            hex: hex::encode(raw),
        }
    }

    pub fn hex(&self) -> &str {
        &self.hex
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sha256:{}", self.hex)
    }
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sha256:{}", &self.hex)
    }
}

impl FromStr for Digest {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        Self::parse(s)
    }
}

impl serde::Serialize for Digest {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Digest {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Self::parse(&s).map_err(serde::de::Error::custom)
    }
}

/// Incremental sha256 that checks against an expected digest.
#[derive(Clone)]
pub struct Verifier {
    expected: Digest,
    hasher: Sha256,
    len: u64,
}

impl Verifier {
    pub fn new(expected: Digest) -> Self {
        Self {
            expected,
            hasher: Sha256::new(),
            len: 0,
        }
    }

    pub fn update(&mut self, chunk: &[u8]) {
        self.len += chunk.len() as u64;
        self.hasher.update(chunk);
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Consumes the verifier; `Ok` only when the bytes hash to the expected digest.
    pub fn finish(self) -> Result<(), Error> {
        let got = Digest::from_sha256(self.hasher.finalize().into());
        if got == self.expected {
            Ok(())
        } else {
            Err(Error::DigestMismatch {
                expected: self.expected,
                actual: got,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_rejects() {
        let d = Digest::of(b"hello");
        assert_eq!(
            d.to_string(),
            "sha256:2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"
        );
        assert_eq!(Digest::parse(&d.to_string()).unwrap(), d);
        assert!(matches!(
            Digest::parse("sha256:abc"),
            Err(Error::DigestInvalid(_))
        ));
        assert!(matches!(
            Digest::parse("md5:abc"),
            Err(Error::DigestInvalid(_))
        ));
        assert!(matches!(
            Digest::parse(&format!("sha512:{}", "a".repeat(128))),
            Err(Error::Unsupported(_))
        ));
        assert!(matches!(
            Digest::parse("sha256:"),
            Err(Error::DigestInvalid(_))
        ));
        let upper = d.to_string().to_uppercase().replace("SHA256", "sha256");
        assert!(Digest::parse(&upper).is_err());
    }

    #[test]
    fn verifier_detects_mismatch() {
        let mut v = Verifier::new(Digest::of(b"abc"));
        v.update(b"ab");
        v.update(b"c");
        assert!(v.finish().is_ok());
        let mut v = Verifier::new(Digest::of(b"abc"));
        v.update(b"abd");
        assert!(matches!(v.finish(), Err(Error::DigestMismatch { .. })));
    }
}
