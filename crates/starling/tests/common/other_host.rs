//! "Another host" for tests that need an address that is not loopback, without
//! leaving the machine.

/// A network namespace joined to this host by a veth pair: "another host" for the
/// agent, without leaving the machine. Removed on drop.
pub struct OtherHost {
    ns: String,
    host_if: String,
    pub host_ip: String,
}

impl OtherHost {
    /// Named after the test process (nextest runs each test in one of its own); `net`,
    /// the second octet of its 10.net.y.0/30, differs per test file, so that processes
    /// whose ids collide modulo 250 in `y` still get subnets apart.
    pub fn create(net: u8) -> OtherHost {
        let id = std::process::id() % 10_000;
        let ns = format!("stl-other-{id}");
        let (host_if, peer_if) = (format!("stlh{id}"), format!("stlp{id}"));
        let net = format!("10.{net}.{}", id % 250);
        let (host_ip, peer_ip) = (format!("{net}.1"), format!("{net}.2"));
        let h = OtherHost {
            ns: ns.clone(),
            host_if: host_if.clone(),
            host_ip: host_ip.clone(),
        };
        for cmd in [
            format!("ip netns add {ns}"),
            format!("ip link add {host_if} type veth peer name {peer_if}"),
            format!("ip link set {peer_if} netns {ns}"),
            format!("ip addr add {host_ip}/30 dev {host_if}"),
            format!("ip link set {host_if} up"),
            format!("ip -n {ns} addr add {peer_ip}/30 dev {peer_if}"),
            format!("ip -n {ns} link set {peer_if} up"),
            format!("ip -n {ns} link set lo up"),
        ] {
            let st = std::process::Command::new("sh")
                .args(["-c", &cmd])
                .status()
                .expect("run ip");
            assert!(
                st.success(),
                "{cmd} failed (the test needs root for network namespaces)"
            );
        }
        h
    }

    /// The HTTP status `url` answers to a client inside the other host.
    pub fn status(&self, url: &str) -> String {
        self.status_with(url, &[])
    }

    /// As [`OtherHost::status`], sending `headers` ("Name: value").
    pub fn status_with(&self, url: &str, headers: &[&str]) -> String {
        let out = std::process::Command::new("ip")
            .args([
                "netns",
                "exec",
                &self.ns,
                "curl",
                "-s",
                "-o",
                "/dev/null",
                "-m",
                "5",
            ])
            .args(headers.iter().flat_map(|h| ["-H", h]))
            .args(["-w", "%{http_code}", url])
            .output()
            .expect("curl in the namespace");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

impl Drop for OtherHost {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip")
            .args(["link", "del", &self.host_if])
            .status();
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", &self.ns])
            .status();
    }
}
