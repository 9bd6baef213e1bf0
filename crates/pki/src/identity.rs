//! Who a certificate speaks for: the role/name grammar and reading it out of a
//! certificate.

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use x509_parser::certificate::X509Certificate;
use x509_parser::extensions::GeneralName;
use x509_parser::prelude::FromDer;

use crate::error::{Error, Result};

/// The URI scheme of identity SANs: `starling:<role>:<name>`.
pub const IDENTITY_SCHEME: &str = "starling";
/// Longest accepted name (bytes), the DNS / Kubernetes subdomain limit.
pub const MAX_NAME_LEN: usize = 253;
/// Longest accepted dot-separated label of a name, the DNS label limit.
pub const MAX_LABEL_LEN: usize = 63;

/// Checks a name against the grammar every Starling name follows.
///
/// A name is a lowercase RFC 1123 DNS subdomain: 1–253 bytes of dot-separated labels,
/// each label 1–63 characters of `[a-z0-9-]` that starts and ends with `[a-z0-9]`.
/// That is what Kubernetes accepts as a node name (Kubernetes does not bound single
/// labels; we do, so that every name is also a valid host name). Nothing else is
/// accepted: no upper case (names are compared byte for byte, so `Gpu1` and `gpu1` would
/// be two identities for one machine), no `_`, no `*`, no trailing dot, no `:` (it
/// separates the fields of an identity URI).
pub fn validate_name(name: &str) -> Result<()> {
    let invalid = |reason| Error::InvalidName {
        name: name.to_owned(),
        reason,
    };
    if name.is_empty() {
        return Err(invalid("empty"));
    }
    if name.len() > MAX_NAME_LEN {
        return Err(invalid("longer than 253 characters"));
    }
    for label in name.split('.') {
        if label.is_empty() {
            return Err(invalid("empty label (leading, trailing or doubled dot)"));
        }
        if label.len() > MAX_LABEL_LEN {
            return Err(invalid("a label is longer than 63 characters"));
        }
        if !label
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        {
            return Err(invalid("only a-z, 0-9, '-' and '.' are allowed"));
        }
        if label.starts_with('-') || label.ends_with('-') {
            return Err(invalid("a label starts or ends with '-'"));
        }
    }
    Ok(())
}

/// What a certificate holder may do in the cluster. Authorization is the HTTP layer's
/// business; the role is what it decides on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    /// An agent on a cluster node: announces to the tracker, serves and fetches pieces.
    Node,
    /// A person or automation allowed to change the cluster (prewarm, tokens).
    Operator,
    /// Read-only access to the tracker's APIs and dashboard.
    Viewer,
    /// The tracker's server certificate.
    Tracker,
}

impl Role {
    /// Every role, in a fixed order.
    pub const ALL: [Role; 4] = [Role::Node, Role::Operator, Role::Viewer, Role::Tracker];

    /// The role as it appears in an identity URI.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Node => "node",
            Role::Operator => "operator",
            Role::Viewer => "viewer",
            Role::Tracker => "tracker",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Role {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        Role::ALL
            .into_iter()
            .find(|role| role.as_str() == s)
            .ok_or_else(|| Error::InvalidIdentity {
                value: s.to_owned(),
                reason: "unknown role (node, operator, viewer, tracker)",
            })
    }
}

/// A role and a validated name; carried in certificates as the URI SAN
/// `starling:<role>:<name>`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Identity {
    role: Role,
    name: String,
}

impl Identity {
    /// An identity; the name must pass [`validate_name`].
    pub fn new(role: Role, name: impl Into<String>) -> Result<Self> {
        let name = name.into();
        validate_name(&name)?;
        Ok(Identity { role, name })
    }

    /// `starling:node:<name>`.
    pub fn node(name: impl Into<String>) -> Result<Self> {
        Identity::new(Role::Node, name)
    }

    /// `starling:operator:<name>`.
    pub fn operator(name: impl Into<String>) -> Result<Self> {
        Identity::new(Role::Operator, name)
    }

    /// `starling:viewer:<name>`.
    pub fn viewer(name: impl Into<String>) -> Result<Self> {
        Identity::new(Role::Viewer, name)
    }

    /// `starling:tracker:<name>`.
    pub fn tracker(name: impl Into<String>) -> Result<Self> {
        Identity::new(Role::Tracker, name)
    }

    /// The role.
    pub fn role(&self) -> Role {
        self.role
    }

    /// The name (a node name for nodes).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The URI SAN form, `starling:<role>:<name>`.
    pub fn to_uri(&self) -> String {
        format!("{IDENTITY_SCHEME}:{}:{}", self.role, self.name)
    }

    /// Parses `starling:<role>:<name>`, exactly (lower case, nothing around it).
    pub fn parse_uri(uri: &str) -> Result<Self> {
        let invalid = |reason| Error::InvalidIdentity {
            value: uri.to_owned(),
            reason,
        };
        let mut parts = uri.splitn(3, ':');
        let (Some(scheme), Some(role), Some(name)) = (parts.next(), parts.next(), parts.next())
        else {
            return Err(invalid("expected starling:<role>:<name>"));
        };
        if scheme != IDENTITY_SCHEME {
            return Err(invalid("scheme is not 'starling'"));
        }
        let role = role.parse::<Role>().map_err(|_| invalid("unknown role"))?;
        Identity::new(role, name)
    }

    /// The identity of an end-entity certificate (DER). Exactly one URI SAN with the
    /// `starling` scheme must be present; zero or several are refused, and so is a
    /// malformed one (it is not skipped: a certificate that tries to say something we
    /// cannot read is not believed at all). Chain validation is not done here; the TLS
    /// verifiers do it before they call this.
    pub fn from_cert_der(der: &[u8]) -> Result<Self> {
        let cert = parse_cert(der)?;
        identity_of(&cert)
    }
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{IDENTITY_SCHEME}:{}:{}", self.role, self.name)
    }
}

impl FromStr for Identity {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        Identity::parse_uri(s)
    }
}

/// What the TLS layer and the renewal logic need to know about a certificate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertInfo {
    /// The Starling identity.
    pub identity: Identity,
    /// Serial number, big-endian bytes.
    pub serial: Vec<u8>,
    /// Start of validity.
    pub not_before: SystemTime,
    /// End of validity.
    pub not_after: SystemTime,
    /// DNS SANs (tracker and node certificates may carry them).
    pub dns_names: Vec<String>,
    /// IP address SANs.
    pub ip_addresses: Vec<IpAddr>,
}

impl CertInfo {
    /// Reads an end-entity certificate (DER). Fails like [`Identity::from_cert_der`].
    pub fn from_der(der: &[u8]) -> Result<Self> {
        let cert = parse_cert(der)?;
        let identity = identity_of(&cert)?;
        let mut dns_names = Vec::new();
        let mut ip_addresses = Vec::new();
        if let Some(san) = cert
            .subject_alternative_name()
            .map_err(|e| Error::bad("certificate", e))?
        {
            for name in &san.value.general_names {
                match name {
                    GeneralName::DNSName(dns) => dns_names.push((*dns).to_owned()),
                    GeneralName::IPAddress(bytes) => {
                        if let Some(ip) = ip_from_bytes(bytes) {
                            ip_addresses.push(ip);
                        }
                    }
                    _ => {}
                }
            }
        }
        Ok(CertInfo {
            identity,
            serial: cert.raw_serial().to_vec(),
            not_before: unix_to_system(cert.validity().not_before.timestamp()),
            not_after: unix_to_system(cert.validity().not_after.timestamp()),
            dns_names,
            ip_addresses,
        })
    }

    /// The serial number as lowercase hex, as `openssl x509 -serial` shows it.
    pub fn serial_hex(&self) -> String {
        hex::encode(&self.serial)
    }

    /// Total lifetime (zero when the dates are inverted).
    pub fn lifetime(&self) -> Duration {
        self.not_after
            .duration_since(self.not_before)
            .unwrap_or_default()
    }

    /// When the certificate should be replaced: at 2/3 of its lifetime, so a renewal that
    /// fails has the remaining third (8 h for a 24 h node certificate) to be retried.
    pub fn renew_at(&self) -> SystemTime {
        self.not_before + self.lifetime() * 2 / 3
    }

    /// Whether [`CertInfo::renew_at`] has been reached at `now`.
    pub fn needs_renewal(&self, now: SystemTime) -> bool {
        now >= self.renew_at()
    }
}

pub(crate) fn parse_cert(der: &[u8]) -> Result<X509Certificate<'_>> {
    let (rest, cert) = X509Certificate::from_der(der).map_err(|e| Error::bad("certificate", e))?;
    if !rest.is_empty() {
        return Err(Error::bad("certificate", "trailing bytes after the DER"));
    }
    Ok(cert)
}

fn identity_of(cert: &X509Certificate<'_>) -> Result<Identity> {
    let san = cert
        .subject_alternative_name()
        .map_err(|e| Error::bad("certificate", e))?;
    let mut uris = san
        .iter()
        .flat_map(|san| san.value.general_names.iter())
        .filter_map(|name| match name {
            GeneralName::URI(uri) => Some(*uri),
            _ => None,
        })
        // The scheme is case-insensitive in URIs; counting `STARLING:` too means a second
        // identity cannot hide behind a different spelling.
        .filter(|uri| {
            uri.split_once(':')
                .is_some_and(|(scheme, _)| scheme.eq_ignore_ascii_case(IDENTITY_SCHEME))
        });
    match (uris.next(), uris.count()) {
        (None, _) => Err(Error::NoIdentity),
        (Some(uri), 0) => Identity::parse_uri(uri),
        (Some(_), more) => Err(Error::MultipleIdentities { count: more + 1 }),
    }
}

fn ip_from_bytes(bytes: &[u8]) -> Option<IpAddr> {
    match bytes.len() {
        4 => <[u8; 4]>::try_from(bytes).ok().map(IpAddr::from),
        16 => <[u8; 16]>::try_from(bytes).ok().map(IpAddr::from),
        _ => None,
    }
}

pub(crate) fn unix_to_system(secs: i64) -> SystemTime {
    if secs >= 0 {
        UNIX_EPOCH + Duration::from_secs(secs.unsigned_abs())
    } else {
        UNIX_EPOCH - Duration::from_secs(secs.unsigned_abs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_that_follow_the_grammar() {
        for name in [
            "a",
            "gpu-017",
            "node1.rack12.example.com",
            "10.0.0.5",
            "0",
            &"a".repeat(63),
            &format!(
                "{}.{}.{}.{}",
                "a".repeat(63),
                "b".repeat(63),
                "c".repeat(63),
                "d".repeat(61)
            ),
        ] {
            assert!(validate_name(name).is_ok(), "{name:?} should be valid");
        }
    }

    #[test]
    fn names_that_break_the_grammar() {
        let too_long = format!(
            "{}.{}.{}.{}",
            "a".repeat(63),
            "b".repeat(63),
            "c".repeat(63),
            "d".repeat(62)
        );
        assert_eq!(too_long.len(), 254);
        for name in [
            "",
            "Gpu1",
            "gpu_1",
            "-gpu",
            "gpu-",
            "a..b",
            ".a",
            "a.",
            "a:b",
            "a*",
            "a b",
            "ä",
            "node/1",
            &"a".repeat(64),
            &too_long,
        ] {
            assert!(
                matches!(validate_name(name), Err(Error::InvalidName { .. })),
                "{name:?} should be invalid"
            );
        }
    }

    #[test]
    fn identity_uri_round_trip() {
        for role in Role::ALL {
            let id = Identity::new(role, "n-1.example").expect("valid");
            let uri = id.to_uri();
            assert_eq!(uri, format!("starling:{role}:n-1.example"));
            assert_eq!(id.to_string(), uri);
            assert_eq!(Identity::parse_uri(&uri).expect("parses"), id);
            assert_eq!(uri.parse::<Identity>().expect("parses"), id);
        }
    }

    #[test]
    fn malformed_identity_uris_are_refused() {
        for uri in [
            "",
            "starling",
            "starling:node",
            "starling:node:",
            "Starling:node:a",
            "spiffe:node:a",
            "starling:admin:a",
            "starling:Node:a",
            "starling:node:A",
            "starling:node:a:b",
            "starling::a",
        ] {
            assert!(
                Identity::parse_uri(uri).is_err(),
                "{uri:?} should be refused"
            );
        }
    }

    #[test]
    fn role_parse() {
        for role in Role::ALL {
            assert_eq!(role.as_str().parse::<Role>().expect("parses"), role);
        }
        assert!("NODE".parse::<Role>().is_err());
    }

    #[test]
    fn garbage_der_is_bad_input_not_a_panic() {
        assert!(matches!(
            Identity::from_cert_der(b"not a certificate"),
            Err(Error::BadInput { .. })
        ));
        assert!(matches!(
            Identity::from_cert_der(&[]),
            Err(Error::BadInput { .. })
        ));
    }

    #[test]
    fn renewal_at_two_thirds() {
        let start = UNIX_EPOCH + Duration::from_secs(1_000_000);
        let info = CertInfo {
            identity: Identity::node("a").expect("valid"),
            serial: vec![1],
            not_before: start,
            not_after: start + Duration::from_secs(24 * 3600),
            dns_names: vec![],
            ip_addresses: vec![],
        };
        assert_eq!(info.renew_at(), start + Duration::from_secs(16 * 3600));
        assert!(!info.needs_renewal(start + Duration::from_secs(16 * 3600 - 1)));
        assert!(info.needs_renewal(start + Duration::from_secs(16 * 3600)));
        assert!(info.needs_renewal(start + Duration::from_secs(30 * 3600)));
    }

    #[test]
    fn unix_times_before_the_epoch() {
        assert_eq!(unix_to_system(-10), UNIX_EPOCH - Duration::from_secs(10));
        assert_eq!(unix_to_system(10), UNIX_EPOCH + Duration::from_secs(10));
    }
}
