//! Seed inputs for every target, made by the real code where there is one: frames
//! from `Frame::encode`, announces and reports serialised from the real types, routes
//! and headers as containerd, Docker and registries send them, manifests in the shapes
//! the test registries serve (`testkit`, `analyze` fixtures). `examples/write_seeds.rs`
//! writes them under `fuzz/corpus/<target>/seed-*`; the replay test also runs them
//! directly, so a seed that stops passing its check fails CI even before it is
//! written out.

use bytes::BytesMut;
use cluster::NodeReport;
use oci::media::{
    DOCKER_MANIFEST, DOCKER_MANIFEST_LIST, OCI_CONFIG, OCI_INDEX, OCI_LAYER_GZIP, OCI_MANIFEST,
};
use oci::Digest;
use swarm::pieces::PieceHash;
use swarm::protocol::AnnounceRequest;
use swarm::wire::{Frame, RejectReason, PROTOCOL_VERSION};
use swarm::Bitfield;

use crate::cluster_checks::real_reports;
use crate::swarm_checks::swarm_announces;

/// One seed: target, file name (without the `seed-` prefix), bytes.
pub type Seed = (&'static str, String, Vec<u8>);

fn d(s: &str) -> String {
    Digest::of(s.as_bytes()).to_string()
}

/// `Input::number` reads a width selector, then the value: 3 = a big-endian u64.
fn number(n: u64) -> Vec<u8> {
    let mut v = vec![3];
    v.extend_from_slice(&n.to_be_bytes());
    v
}

fn frame(f: &Frame) -> Vec<u8> {
    let mut b = BytesMut::new();
    f.encode(&mut b);
    b.to_vec()
}

fn json<T: serde::Serialize>(v: &T) -> Vec<u8> {
    serde_json::to_vec(v).unwrap_or_default()
}

fn lines(items: impl IntoIterator<Item = Vec<u8>>) -> Vec<u8> {
    let mut out = Vec::new();
    for (i, item) in items.into_iter().enumerate() {
        if i > 0 {
            out.push(b'\n');
        }
        out.extend(item);
    }
    out
}

pub fn seeds() -> Vec<Seed> {
    let mut out: Vec<Seed> = Vec::new();
    let mut add = |target: &'static str, name: &str, bytes: Vec<u8>| {
        out.push((target, name.to_owned(), bytes));
    };

    // route: request targets as containerd (with ?ns=) and Docker (without) send them.
    let blob = d("layer");
    let routes = [
        ("base", "/v2/".to_owned()),
        ("base-bare", "/v2".to_owned()),
        (
            "containerd-tag",
            "/v2/library/ubuntu/manifests/22.04?ns=docker.io".to_owned(),
        ),
        (
            "containerd-blob-port",
            format!("/v2/team/train/blobs/{blob}?ns=registry.local%3A5000"),
        ),
        (
            "manifest-digest",
            format!("/v2/library/python/manifests/{}?ns=index.docker.io", d("m")),
        ),
        ("tags-list", "/v2/a/b/c/tags/list?n=100&last=v1".to_owned()),
        (
            "referrers",
            format!("/v2/team/train/referrers/{blob}?artifactType=application%2Fvnd.example"),
        ),
        (
            "repo-named-manifests",
            format!("/v2/k8s/manifests/blobs/{blob}?ns=ghcr.io"),
        ),
        (
            "repo-named-blobs",
            "/v2/ci/blobs/cache/manifests/latest?ns=registry.local%3A5000".to_owned(),
        ),
        ("dotdot-encoded", "/v2/a/%2e%2e/blobs/sha256:00".to_owned()),
        ("dotdot", format!("/v2/a/../b/blobs/{blob}")),
        ("other-api", "/v3/x".to_owned()),
        (
            "ns-metadata",
            "/v2/x/manifests/latest?ns=169.254.169.254".to_owned(),
        ),
        (
            "ns-allowed-suffix",
            "/v2/x/manifests/latest?ns=mirror.example.com&ns=docker.io".to_owned(),
        ),
        (
            "ns-lookalike",
            "/v2/x/manifests/latest?ns=evil-example.com".to_owned(),
        ),
        (
            "ns-ipv6",
            "/v2/x/manifests/v1?ns=%5B%3A%3A1%5D%3A5000".to_owned(),
        ),
        ("ns-plus", "/v2/x/manifests/v1?ns=a+b%zz%4".to_owned()),
    ];
    for (name, r) in routes {
        add("route", name, r.into_bytes());
    }

    // range: a blob size, then a Range header.
    let ranges = [
        ("first-kib", 4096, "bytes=0-1023"),
        ("suffix", 4096, "bytes=-500"),
        ("open", 4 << 20, "bytes=1048576-"),
        ("multi", 1 << 20, "bytes=0-9,100-109,5-20"),
        (
            "overlap-whole",
            4 << 20,
            "bytes=0-4194303,0-4194303,0-4194303",
        ),
        ("resume-past-end", 1000, "bytes=1000-"),
        ("zero-suffix", 1000, "bytes=-0"),
        ("empty-blob", 0, "bytes=-10"),
        (
            "huge-values",
            u64::MAX,
            "bytes=18446744073709551614-,0-18446744073709551615",
        ),
        ("unit", 100, "items=0-1"),
        ("overflow", 100, "bytes=99999999999999999999999-"),
    ];
    for (name, total, h) in ranges {
        let mut v = number(total);
        v.extend_from_slice(h.as_bytes());
        add("range", name, v);
    }
    let many: Vec<String> = (0..17)
        .map(|i| format!("{}-{}", i * 1000, i * 1000 + 9))
        .collect();
    let mut v = number(1_000_000);
    v.extend_from_slice(format!("bytes={}", many.join(",")).as_bytes());
    add("range", "seventeen-parts", v);

    // content_range: 206 answers from registries on resume.
    for (name, v) in [
        ("resume", "bytes 1048576-4194303/4194304"),
        ("unknown-total", "bytes 10-19/*"),
        ("unsatisfied", "bytes */100"),
        ("end-before-start", "bytes 100-99/200"),
        ("end-past-total", "bytes 0-10/5"),
        ("unit", "items 1-2/3"),
        ("signed", "bytes +1-2/3"),
    ] {
        add("content_range", name, v.as_bytes().to_vec());
    }

    // digest
    add("digest", "sha256", d("hello").into_bytes());
    add(
        "digest",
        "empty-blob",
        Digest::of(b"").to_string().into_bytes(),
    );
    add(
        "digest",
        "sha512",
        format!("sha512:{}", "ab".repeat(64)).into_bytes(),
    );
    add(
        "digest",
        "upper",
        d("x")
            .to_uppercase()
            .replace("SHA256", "sha256")
            .into_bytes(),
    );
    add("digest", "short", b"sha256:abc".to_vec());
    add("digest", "no-algorithm", b"2cf24dba5fb0a30e".to_vec());

    // reference
    for (name, r) in [
        ("hub-short", "ubuntu".to_owned()),
        ("hub-full", "docker.io/library/python:3.12".to_owned()),
        (
            "private-port",
            "registry.local:5000/team/train:v42".to_owned(),
        ),
        ("pinned", format!("127.0.0.1:5000/a/b@{}", d("m"))),
        ("tag-and-digest", format!("ghcr.io/org/img:1.0@{}", d("m"))),
        ("localhost", "localhost/x".to_owned()),
        ("ipv6", "[::1]:5000/a:b".to_owned()),
        ("hub-alias", "Index.Docker.IO/x".to_owned()),
        ("upper-repo", "a/B".to_owned()),
        ("separators", "a__b/c--d/e.f_g".to_owned()),
        ("double-tag", "x:y:z".to_owned()),
    ] {
        add("reference", name, r.into_bytes());
    }

    // manifest: an Accept line, then the body, in the shapes registries serve.
    let layer = |n: &str| serde_json::json!({"mediaType": OCI_LAYER_GZIP, "digest": d(n), "size": 32_654_321});
    let oci_manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": {"mediaType": OCI_CONFIG, "digest": d("config"), "size": 1469},
        "layers": [layer("l1"), layer("l2"), layer("l3")],
        "annotations": {"org.opencontainers.image.created": "2024-05-01T00:00:00Z"}
    });
    let index = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": OCI_INDEX,
        "manifests": [
            {"mediaType": OCI_MANIFEST, "digest": d("amd64"), "size": 1234,
             "platform": {"architecture": "amd64", "os": "linux"}},
            {"mediaType": OCI_MANIFEST, "digest": d("arm64"), "size": 1234,
             "platform": {"architecture": "arm64", "os": "linux", "variant": "v8"}},
            {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": d("att"),
             "size": 840, "annotations": {"vnd.docker.reference.type": "attestation-manifest"},
             "platform": {"architecture": "unknown", "os": "unknown"}}
        ]
    });
    let docker = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": DOCKER_MANIFEST,
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                   "digest": d("dc"), "size": 7023},
        "layers": [{"mediaType": "application/vnd.docker.image.rootfs.diff.tar.gzip",
                    "digest": d("dl"), "size": 32_654}]
    });
    let list = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": DOCKER_MANIFEST_LIST,
        "manifests": [{"mediaType": DOCKER_MANIFEST, "digest": d("win"), "size": 2,
                       "platform": {"architecture": "amd64", "os": "windows"}}]
    });
    let untyped_index = serde_json::json!({"schemaVersion": 2, "manifests": [
        {"digest": d("u"), "size": 3}]});
    let accept = oci::media::DEFAULT_ACCEPT;
    for (name, a, m) in [
        ("oci-manifest", accept, oci_manifest),
        ("oci-index", "application/*", index),
        ("docker-v2", DOCKER_MANIFEST, docker),
        ("docker-list", "text/plain, */*;q=0.1", list),
        ("untyped-index", "", untyped_index),
    ] {
        let mut v = a.as_bytes().to_vec();
        v.push(b'\n');
        v.extend(json(&m));
        add("manifest", name, v);
    }
    add(
        "manifest",
        "schema1",
        b"\n{\"schemaVersion\":1,\"name\":\"x\",\"fsLayers\":[]}".to_vec(),
    );

    // challenge: WWW-Authenticate as Docker Hub, GHCR, distribution's htpasswd send it.
    for (name, c) in [
        (
            "docker-hub",
            r#"Bearer realm="https://auth.docker.io/token",service="registry.docker.io",scope="repository:library/ubuntu:pull""#,
        ),
        (
            "ghcr",
            r#"Bearer realm="https://ghcr.io/token",service="ghcr.io",scope="repository:user/image:pull""#,
        ),
        ("htpasswd", r#"Basic realm="Registry Realm""#),
        (
            "scope-commas",
            r#"bearer realm="https://a/t", scope="repository:a/b:pull,push", service=reg"#,
        ),
        ("escapes", r#"Bearer realm="a\"b\\c",service="""#),
        ("negotiate", "Negotiate"),
        ("no-realm", "Bearer service=x"),
    ] {
        add("challenge", name, c.as_bytes().to_vec());
    }

    // bitfield: [mode][number: piece count][raw | base64 | JSON]
    let mut bits = Bitfield::new(13);
    for i in [0, 1, 2, 7, 12] {
        bits.set(i);
    }
    let bf = |mode: u8, len: u64, rest: &[u8]| {
        let mut v = vec![mode];
        v.extend(number(len));
        v.extend_from_slice(rest);
        v
    };
    add("bitfield", "raw", bf(0, 13, bits.as_bytes()));
    add("bitfield", "raw-padding-set", bf(0, 3, &[0xff]));
    add("bitfield", "base64", bf(1, 13, bits.to_base64().as_bytes()));
    add("bitfield", "json", bf(2, 0, &json(&bits)));
    add(
        "bitfield",
        "json-full-64",
        bf(2, 0, &json(&Bitfield::full(64))),
    );
    add(
        "bitfield",
        "too-many",
        bf(2, 0, br#"{"len":4294967295,"bits":"AAAA"}"#),
    );

    // frame_decode: frames from Frame::encode, alone and as a session's stream.
    let mut have = Bitfield::new(64);
    for i in (0..64).step_by(3) {
        have.set(i);
    }
    let frames = [
        (
            "hello",
            Frame::Hello {
                version: PROTOCOL_VERSION,
                node: "gpu-node-017.rack-12.us-east-1a".into(),
                addr: "10.12.0.17:5001".into(),
                nonce: [7; 16],
                proof: [0; 32],
            },
        ),
        (
            "have-filter",
            Frame::HaveFilter {
                chan: 1,
                filter: swarm::links::HaveFilter {
                    modulus: 32,
                    residue: 7,
                },
            },
        ),
        ("auth", Frame::Auth { proof: [9; 32] }),
        (
            "open",
            Frame::Open {
                chan: 1,
                digest: [5; 32],
                blob_size: 1536 << 20,
                piece_size: 16 << 20,
            },
        ),
        ("bitfield", Frame::Bitfield { chan: 1, have }),
        ("complete", Frame::Complete { chan: 2 }),
        ("not-held", Frame::NotHeld { chan: 3 }),
        (
            "have",
            Frame::Have {
                chan: 1,
                piece: 9,
                hash: Some(PieceHash::of(b"piece 9")),
            },
        ),
        (
            "request",
            Frame::Request {
                chan: 1,
                piece: 0,
                urgent: true,
            },
        ),
        ("cancel", Frame::Cancel { chan: 1, piece: 4 }),
        (
            "reject",
            Frame::Reject {
                chan: 1,
                piece: 4,
                reason: RejectReason::Busy,
            },
        ),
        (
            "data",
            Frame::Data {
                chan: 1,
                piece: 0,
                offset: 0,
                len: 16,
            },
        ),
        ("hashes-request", Frame::HashesRequest { chan: 1 }),
        (
            "hashes",
            Frame::Hashes {
                chan: 1,
                first: 0,
                hashes: (0u32..8).map(|i| PieceHash::of(&i.to_le_bytes())).collect(),
            },
        ),
        ("ping", Frame::Ping { nonce: 42 }),
        ("pong", Frame::Pong { nonce: 42 }),
        (
            "goodbye",
            Frame::Goodbye {
                reason: "shutting down: upload limit reached".into(),
            },
        ),
    ];
    let mut session = Vec::new();
    for (name, f) in &frames {
        let b = frame(f);
        add("frame_decode", name, b.clone());
        session.extend_from_slice(&b);
        if let Frame::Data { len, .. } = f {
            session.extend(std::iter::repeat_n(0xabu8, *len as usize));
        }
    }
    add("frame_decode", "session", session);

    // frame_roundtrip: the builder's input: [chan u32][variant][fields...]
    let rt = |variant: u8, fields: &[u8]| {
        let mut v = vec![0, 0, 0, 7, variant];
        v.extend_from_slice(fields);
        v
    };
    let mut long_name = 300u16.to_be_bytes().to_vec();
    long_name.extend("é".repeat(150).as_bytes());
    add(
        "frame_roundtrip",
        "hello",
        rt(0, &[0, 1, 0, 6, b'g', b'p', b'u', b'-', b'0', b'1']),
    );
    add(
        "frame_roundtrip",
        "hello-long-name",
        rt(0, &[&[0, 1][..], &long_name].concat()),
    );
    let mut open = vec![0; 32];
    open.extend(number(1 << 30));
    open.extend(number(4 << 20));
    add("frame_roundtrip", "open", rt(2, &open));
    let mut bitfield = number(100);
    bitfield.extend_from_slice(&[3, 0, 0, 0, 1, 0, 0, 0, 50, 0, 0, 0, 99]);
    add("frame_roundtrip", "bitfield", rt(4, &bitfield));
    add("frame_roundtrip", "have", rt(7, &[0, 0, 0, 3, 1]));
    let mut data = vec![0, 0, 0, 1, 0, 0, 16, 0];
    data.extend(number(1 << 20));
    add("frame_roundtrip", "data", rt(11, &data));
    let mut hashes = number(65_530);
    hashes.extend_from_slice(&[0, 8]);
    add("frame_roundtrip", "hashes-near-max", rt(13, &hashes));
    let mut goodbye = 1100u16.to_be_bytes().to_vec();
    goodbye.extend("→".repeat(400).as_bytes());
    add("frame_roundtrip", "goodbye-long", rt(16, &goodbye));

    // selector
    for (name, s) in [
        ("equals", "gpu=h100"),
        ("set-and-not", "gpu in (h100,a100),!spot"),
        ("notin", "env notin (dev, test)"),
        ("exists", "tier"),
        ("double-equals", "a==b,c!=d"),
        ("prefixed", "example.com/pool=train"),
        ("empty-set", "a in ()"),
        ("empty-value", "a="),
        ("space-in-key", "bad key=x"),
        ("trailing-comma", "a=b,"),
    ] {
        add("selector", name, s.as_bytes().to_vec());
    }

    // node_report: reports as agents send them, one per line.
    let reports = real_reports();
    for r in &reports {
        add("node_report", &format!("report-{}", r.node), json(r));
    }
    let mut newer = reports[1].clone();
    newer.generation += 1;
    newer.blobs.truncate(1);
    let mut stale = reports[0].clone();
    stale.generation -= 1;
    let mut lines_in = reports.iter().map(json).collect::<Vec<_>>();
    lines_in.push(json(&newer));
    lines_in.push(json(&stale));
    add("node_report", "cluster", lines(lines_in));
    let mut big = reports[0].clone();
    big.node = "greedy".into();
    big.labels = (0..20).map(|i| (format!("k{i}"), "v".to_owned())).collect();
    add("node_report", "too-many-labels", json::<NodeReport>(&big));

    // prewarm_request: bodies as `starling prewarm` posts them.
    for (name, body) in [
        (
            "selector",
            r#"{"images":["registry.local:5000/team/train:v42"],"targets":{"selector":"gpu=h100"},"parallelism":8,"per_node_bytes_per_sec":209715200,"pin_ttl_seconds":43200}"#,
        ),
        (
            "nodes",
            r#"{"images":["registry.local:5000/team/eval:v1"],"targets":{"nodes":["gpu-1","gpu-2","gpu-2"]},"total_bytes_per_sec":1000000,"deadline_seconds":3600}"#,
        ),
        (
            "pool-count",
            r#"{"images":["docker.io/library/python:3.12"],"targets":{"pool":"train","count":1},"priority":5}"#,
        ),
        (
            "percentage",
            r#"{"images":["registry.local:5000/team/eval:v1"],"targets":{"percentage":50.0},"parallelism":1}"#,
        ),
        (
            "latest-refused",
            r#"{"images":["ubuntu"],"targets":{"count":1}}"#,
        ),
        (
            "forced-latest",
            r#"{"images":["ubuntu:latest"],"targets":{"count":1},"force":true}"#,
        ),
        (
            "pin-too-long",
            r#"{"images":["registry.local:5000/team/train:v42"],"targets":{"count":1},"pin_ttl_seconds":99999999999}"#,
        ),
        (
            "by-digest",
            r#"{"images":["registry.local:5000/team/train@sha256:a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0"],"targets":{"selector":"starling.io/pool in (train,batch)"},"into_runtime":true}"#,
        ),
    ] {
        add("prewarm_request", name, body.as_bytes().to_vec());
    }

    // announce: the agent's announces, one per line.
    let announces = swarm_announces();
    for (i, a) in announces.iter().enumerate() {
        add("announce", &format!("agent-{i}"), json(a));
    }
    let blob_digest = Digest::of(crate::swarm_checks::BLOB);
    let mut first = AnnounceRequest::new(
        "gpu-9",
        "10.0.1.9:5051",
        &announces[1].topology,
        &blob_digest,
    );
    first.size = Some(64 << 20);
    first.piece_size = Some(1 << 20);
    let mut done = first.clone();
    done.complete = true;
    done.have = Some(Bitfield::full(64));
    let mut accuse = first.clone();
    accuse.bad_peers = vec!["gpu-1".into()];
    let mut leave = first.clone();
    leave.leaving = true;
    let mut src_leaves = announces[0].clone();
    src_leaves.leaving = true;
    add(
        "announce",
        "lifecycle",
        lines([json(&first), json(&accuse), json(&done), json(&leave)]),
    );
    add(
        "announce",
        "source-leaves",
        lines([json(&src_leaves), json(&first)]),
    );
    let mut conflict = first.clone();
    conflict.size = Some(65 << 20);
    add("announce", "conflicting-size", json(&conflict));
    out
}
