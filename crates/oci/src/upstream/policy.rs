//! Which registries a server-side client (the agent, the tracker's catalog) may contact.
//!
//! A request names its registry (`?ns=`, an image reference in a prewarm or a scheduler
//! query), so without a rule anyone who can reach the agent or the tracker makes it
//! connect wherever they like: cloud metadata services (169.254.169.254), loopback
//! admin ports, the node's neighbours. The rule: a registry is contacted only when it
//! is configured (named in the configuration, or given an endpoint) or matches an
//! opt-in pattern; and loopback, link-local, unspecified and metadata addresses are
//! reached only for configured registries, whatever a pattern, a redirect, a token
//! realm or a DNS answer says.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;

use crate::reference::canonical_registry;

/// The rule a client applies before it connects anywhere. `configured` are canonical
/// registry names; `patterns` are `host[:port]`, `*.domain[:port]` (any subdomain) or
/// `*` (any registry at all: dangerous, see the README).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RegistryPolicy {
    pub configured: BTreeSet<String>,
    pub patterns: Vec<String>,
}

impl RegistryPolicy {
    pub fn new(
        configured: impl IntoIterator<Item = String>,
        patterns: impl IntoIterator<Item = String>,
    ) -> Self {
        Self {
            configured: configured
                .into_iter()
                .map(|r| canonical_registry(&r))
                .collect(),
            patterns: patterns
                .into_iter()
                .map(|p| p.trim().to_ascii_lowercase())
                .filter(|p| !p.is_empty())
                .collect(),
        }
    }

    /// Whether `registry` (canonical) may be contacted at all.
    pub fn allows(&self, registry: &str) -> bool {
        self.configured.contains(registry)
            || self.patterns.iter().any(|p| pattern_matches(p, registry))
    }

    /// Whether `registry` is named in the configuration (and so may live on a loopback
    /// or link-local address).
    pub fn is_configured(&self, registry: &str) -> bool {
        self.configured.contains(registry)
    }

    /// Whether the operator named `registry` itself: configured, or an exact entry of
    /// the allowed patterns (not one a wildcard admits, which may be anyone's server).
    pub fn names(&self, registry: &str) -> bool {
        self.is_configured(registry)
            || self
                .patterns
                .iter()
                .any(|p| !p.contains('*') && pattern_matches(p, registry))
    }
}

/// `host[:port]` → (host, port). IPv6 literals keep their brackets off.
fn split_host_port(name: &str) -> (&str, Option<&str>) {
    if let Some(rest) = name.strip_prefix('[') {
        if let Some((host, tail)) = rest.split_once(']') {
            return (host, tail.strip_prefix(':'));
        }
    }
    match name.rsplit_once(':') {
        Some((h, p)) if !h.contains(':') => (h, Some(p)),
        _ => (name, None),
    }
}

/// `*` matches everything; `*.example.com` matches any name under `example.com` (not
/// `example.com` itself); anything else matches exactly. A port in the pattern must be
/// the registry's port; a pattern without one matches only names without one.
/// A URL for messages, logs and views: a query (a presigned URL's signature) becomes
/// `?redacted`, user info (credentials) is dropped, and the result is at most 300
/// bytes. What cannot be parsed is cut before any `?` or `@`.
pub fn redact_url(url: &str) -> String {
    let mut out = match url::Url::parse(url) {
        Ok(mut u) => {
            let hidden = u.query().is_some() || !u.username().is_empty() || u.password().is_some();
            u.set_query(hidden.then_some("redacted"));
            u.set_fragment(None);
            let _ = u.set_username("");
            let _ = u.set_password(None);
            u.to_string()
        }
        Err(_) => {
            let cut = url.find(['?', '@', '#']).unwrap_or(url.len());
            format!("{}…", &url[..cut])
        }
    };
    if out.len() > 300 {
        let mut at = 300;
        while !out.is_char_boundary(at) {
            at -= 1;
        }
        out.truncate(at);
        out.push('…');
    }
    out
}

pub fn pattern_matches(pattern: &str, registry: &str) -> bool {
    if pattern == "*" {
        return true;
    }
    let pattern = canonical_registry(pattern);
    let (ph, pp) = split_host_port(&pattern);
    let (rh, rp) = split_host_port(registry);
    if pp != rp {
        return false;
    }
    match ph.strip_prefix("*.") {
        Some(suffix) => rh
            .strip_suffix(suffix)
            .is_some_and(|head| head.len() > 1 && head.ends_with('.')),
        None => ph == rh,
    }
}

/// Loopback, link-local, unspecified, broadcast and cloud metadata addresses: where a
/// request from outside must never lead unless an operator configured it.
pub fn is_internal(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => is_internal_v4(v4),
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return is_internal_v4(v4);
            }
            let seg = v6.segments();
            v6.is_loopback()
                || v6.is_unspecified()
                // fe80::/10 link-local
                || (seg[0] & 0xffc0) == 0xfe80
                // AWS's IPv6 instance metadata endpoint
                || v6 == Ipv6Addr::new(0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254)
        }
    }
}

fn is_internal_v4(v4: Ipv4Addr) -> bool {
    v4.is_loopback()
        || v4.is_link_local()
        || v4.is_unspecified()
        || v4.is_broadcast()
        || v4.octets()[0] == 0
        // Alibaba Cloud's metadata service (outside link-local).
        || v4 == Ipv4Addr::new(100, 100, 100, 200)
}

/// The host of a URL when it names an internal address: an internal IP literal, or
/// `localhost` (which resolves to loopback without asking DNS).
pub(crate) fn internal_host(url: &url::Url) -> Option<String> {
    match url.host()? {
        url::Host::Ipv4(ip) => is_internal(IpAddr::V4(ip)).then(|| ip.to_string()),
        url::Host::Ipv6(ip) => is_internal(IpAddr::V6(ip)).then(|| ip.to_string()),
        url::Host::Domain(d) => {
            let d = d.trim_end_matches('.').to_ascii_lowercase();
            (d == "localhost" || d.ends_with(".localhost")).then_some(d)
        }
    }
}

/// `host:port` of a URL as the trust list keys it.
pub(crate) fn authority(url: &url::Url) -> Option<(String, u16)> {
    let host = match url.host()? {
        url::Host::Domain(d) => d.trim_end_matches('.').to_ascii_lowercase(),
        url::Host::Ipv4(ip) => ip.to_string(),
        url::Host::Ipv6(ip) => ip.to_string(),
    };
    Some((host, url.port_or_known_default()?))
}

/// A DNS answer that contained only internal addresses for a host nobody configured.
#[derive(Debug)]
pub struct InternalAddress {
    pub host: String,
}

impl std::fmt::Display for InternalAddress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} resolves only to loopback, link-local or metadata addresses",
            self.host
        )
    }
}

impl std::error::Error for InternalAddress {}

/// Resolves names for the upstream client and drops internal addresses unless the
/// name is configured, so a pattern-allowed name (or a redirect, or a token realm) that
/// resolves to 169.254.169.254 or 127.0.0.1 never gets a connection.
pub(crate) struct GuardedResolver {
    /// Host names (no port) of configured registries and endpoints.
    pub trusted: Arc<BTreeSet<String>>,
}

impl reqwest::dns::Resolve for GuardedResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let host = name.as_str().trim_end_matches('.').to_ascii_lowercase();
        let trusted = self.trusted.contains(&host);
        Box::pin(async move {
            let addrs: Vec<SocketAddr> = tokio::net::lookup_host((host.as_str(), 0))
                .await?
                .filter(|a| trusted || !is_internal(a.ip()))
                .collect();
            if addrs.is_empty() {
                return Err(Box::new(InternalAddress { host }) as Box<_>);
            }
            Ok(Box::new(addrs.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

/// Whether an error (a reqwest error, through its sources) came from the resolver
/// refusing an internal address.
pub(crate) fn refused_internal(e: &(dyn std::error::Error + 'static)) -> Option<String> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(i) = err.downcast_ref::<InternalAddress>() {
            return Some(i.to_string());
        }
        cur = err.source();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_lose_their_secrets_in_messages() {
        assert_eq!(
            redact_url("https://alice:pw@s3.example.com/b/w.bin?X-Amz-Signature=abc#f"),
            "https://s3.example.com/b/w.bin?redacted"
        );
        assert_eq!(
            redact_url("http://127.0.0.1:8080/w.bin"),
            "http://127.0.0.1:8080/w.bin"
        );
        assert_eq!(redact_url("http://[bad/x?sig=1"), "http://[bad/x…");
        assert_eq!(redact_url("h://u:pw@x"), "h://x?redacted");
        let long = redact_url(&format!("https://e.com/{}", "é".repeat(400)));
        assert!(long.len() <= 304 && !long.contains('?'));
    }

    #[test]
    fn patterns() {
        assert!(pattern_matches("*", "169.254.169.254"));
        assert!(pattern_matches("*.example.com", "reg.example.com"));
        assert!(pattern_matches("*.example.com", "a.b.example.com"));
        assert!(!pattern_matches("*.example.com", "example.com"));
        assert!(!pattern_matches("*.example.com", "evilexample.com"));
        assert!(!pattern_matches("*.example.com", "reg.example.com:5000"));
        assert!(pattern_matches(
            "*.example.com:5000",
            "reg.example.com:5000"
        ));
        assert!(!pattern_matches(
            "*.example.com:5000",
            "reg.example.com:5001"
        ));
        assert!(pattern_matches("ghcr.io", "ghcr.io"));
        assert!(pattern_matches("index.docker.io", "docker.io"));
        assert!(!pattern_matches("ghcr.io", "ghcr.io.evil.com"));
        assert!(pattern_matches("[::1]:5000", "[::1]:5000"));
    }

    #[test]
    fn policy() {
        let p = RegistryPolicy::new(
            [
                "Registry-1.docker.io".to_owned(),
                "127.0.0.1:5000".to_owned(),
            ],
            ["*.corp.example".to_owned()],
        );
        assert!(p.allows("docker.io") && p.is_configured("docker.io"));
        assert!(p.allows("127.0.0.1:5000"));
        assert!(p.allows("reg.corp.example") && !p.is_configured("reg.corp.example"));
        assert!(!p.allows("127.0.0.1:5001"));
        assert!(!p.allows("169.254.169.254"));
    }

    #[test]
    fn internal_addresses() {
        for ip in [
            "127.0.0.1",
            "127.8.9.10",
            "169.254.169.254",
            "0.0.0.0",
            "0.1.2.3",
            "255.255.255.255",
            "100.100.100.200",
            "::1",
            "::",
            "fe80::1",
            "fd00:ec2::254",
            "::ffff:169.254.169.254",
            "::ffff:127.0.0.1",
        ] {
            assert!(is_internal(ip.parse().expect("address")), "{ip}");
        }
        for ip in [
            "10.0.0.1",
            "192.168.1.1",
            "8.8.8.8",
            "2001:db8::1",
            "100.100.100.201",
        ] {
            assert!(!is_internal(ip.parse().expect("address")), "{ip}");
        }
        // The URL parser normalises the odd spellings of an address.
        for u in [
            "https://2130706433/",
            "https://0x7f.1/",
            "https://127.1/",
            "https://[::ffff:a9fe:a9fe]/",
            "http://LOCALHOST:8080/",
            "http://x.localhost/",
        ] {
            let url = url::Url::parse(u).expect("URL");
            assert!(internal_host(&url).is_some(), "{u}");
        }
        let url = url::Url::parse("https://registry.example.com/").expect("URL");
        assert!(internal_host(&url).is_none());
    }
}

#[cfg(test)]
mod client_tests {
    use std::net::SocketAddr;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    use crate::upstream::{RegistryPolicy, Upstream, UpstreamConfig};
    use crate::Error;

    /// A listener that counts connections and closes them.
    async fn counting() -> (SocketAddr, Arc<AtomicUsize>) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = l.local_addr().expect("addr");
        let n = Arc::new(AtomicUsize::new(0));
        let c = n.clone();
        tokio::spawn(async move {
            while let Ok((s, _)) = l.accept().await {
                c.fetch_add(1, Ordering::SeqCst);
                drop(s);
            }
        });
        (addr, n)
    }

    /// A configured "registry" on loopback that answers every request with `resp`.
    async fn registry(resp: axum::response::Response) -> SocketAddr {
        let resp = Arc::new(parking_lot::Mutex::new(Some(resp)));
        let app = axum::Router::new().fallback(move || {
            let resp = resp.clone();
            async move { resp.lock().take().unwrap_or_default() }
        });
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = l.local_addr().expect("addr");
        tokio::spawn(async move { axum::serve(l, app).await });
        addr
    }

    fn client(reg: SocketAddr, patterns: &[&str]) -> Upstream {
        let name = reg.to_string();
        Upstream::new(UpstreamConfig {
            endpoints: [(name.clone(), format!("http://{reg}"))].into(),
            policy: Some(RegistryPolicy::new(
                [name],
                patterns.iter().map(|p| (*p).to_owned()),
            )),
            ..Default::default()
        })
        .expect("client")
    }

    #[tokio::test]
    async fn redirects_realms_and_names_never_lead_inside() {
        let (inside, accepts) = counting().await;
        // A configured registry redirecting to another loopback port.
        let redirect = axum::response::Response::builder()
            .status(307)
            .header("location", format!("http://{inside}/blob"))
            .body(axum::body::Body::empty())
            .expect("response");
        let reg = registry(redirect).await;
        let up = client(reg, &["*"]);
        let d = crate::Digest::of(b"x");
        let e = up
            .head_blob(&reg.to_string(), "a/b", &d)
            .await
            .expect_err("redirect");
        assert!(matches!(e, Error::Denied { .. }), "{e}");
        // A token realm on a link-local address.
        let challenge = axum::response::Response::builder()
            .status(401)
            .header(
                "www-authenticate",
                "Bearer realm=\"http://169.254.169.254/token\",service=\"x\"",
            )
            .body(axum::body::Body::empty())
            .expect("response");
        let reg2 = registry(challenge).await;
        let up2 = client(reg2, &[]);
        let e = up2
            .head_blob(&reg2.to_string(), "a/b", &d)
            .await
            .expect_err("realm");
        assert!(matches!(e, Error::Denied { .. }), "{e}");
        // Names: not configured; "*" still does not open loopback or a name for it.
        for (patterns, name) in [
            (&[][..], inside.to_string()),
            (&["*"][..], inside.to_string()),
            (&["*"][..], format!("localhost:{}", inside.port())),
        ] {
            let e = client(reg, patterns)
                .head_blob(&name, "a/b", &d)
                .await
                .expect_err("denied");
            assert!(
                matches!(e, Error::Denied { .. }),
                "{patterns:?} {name}: {e}"
            );
            assert_eq!(e.oci_status().0, 403);
        }
        assert_eq!(
            accepts.load(Ordering::SeqCst),
            0,
            "nothing connected inside"
        );
    }
}
