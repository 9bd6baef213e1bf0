use std::os::unix::fs::PermissionsExt;

use super::*;

const HOUR: Duration = Duration::from_secs(3600);

fn key() -> BootstrapKey {
    BootstrapKey::generate().expect("key")
}

fn t0() -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(1_800_000_000)
}

#[test]
fn round_trip() {
    let key = key();
    let token = key.create_token_at(t0(), HOUR, None).expect("token");
    assert!(token.starts_with("stb1."));
    assert!(token
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b)));
    let claims = key.verify_at(&token, t0()).expect("valid");
    assert_eq!(claims.expires_at, t0() + HOUR);
    assert_eq!(claims.name_pattern, None);
    assert_eq!(claims.id.len(), 12);
    assert_eq!(token.split('.').nth(1), Some(claims.id.as_str()));
    // Any node name is allowed without a pattern.
    assert_eq!(
        claims.authorize("gpu-1").expect("allowed"),
        Identity::node("gpu-1").expect("name")
    );
    assert!(matches!(
        claims.authorize("Bad"),
        Err(Error::InvalidName { .. })
    ));
}

#[test]
fn tokens_are_unique() {
    let key = key();
    let a = key.create_token_at(t0(), HOUR, None).expect("token");
    let b = key.create_token_at(t0(), HOUR, None).expect("token");
    assert_ne!(a, b);
}

#[test]
fn expired_tokens_are_refused() {
    let key = key();
    let token = key.create_token_at(t0(), HOUR, None).expect("token");
    assert!(
        key.verify_at(&token, t0() + HOUR).is_ok(),
        "valid through its expiry second"
    );
    let err = key
        .verify_at(&token, t0() + HOUR + Duration::from_secs(1))
        .expect_err("expired");
    assert!(matches!(err, Error::TokenExpired { expired_at, .. } if expired_at == t0() + HOUR));
}

#[test]
fn ttl_limits() {
    let key = key();
    assert!(matches!(
        key.create_token_at(t0(), MAX_TOKEN_TTL + Duration::from_secs(1), None),
        Err(Error::TtlTooLong { .. })
    ));
    assert!(matches!(
        key.create_token_at(t0(), Duration::ZERO, None),
        Err(Error::BadInput { .. })
    ));
    assert!(key.create_token_at(t0(), MAX_TOKEN_TTL, None).is_ok());
    // A token that, at verification, still has more than the maximum to live is refused
    // even with a valid MAC (a clock far behind when it was minted, another tool).
    let future = key
        .create_token_at(t0() + 30 * 24 * HOUR, HOUR, None)
        .expect("token");
    assert!(matches!(
        key.verify_at(&future, t0()),
        Err(Error::TtlTooLong { .. })
    ));
}

#[test]
fn token_of_another_cluster_is_refused() {
    let ours = key();
    let theirs = key();
    let token = theirs.create_token_at(t0(), HOUR, None).expect("token");
    assert!(matches!(
        ours.verify_at(&token, t0()),
        Err(Error::TokenNotAuthentic)
    ));
}

#[test]
fn tampered_tokens_are_refused() {
    let key = key();
    let pattern = NamePattern::new("gpu-*").expect("pattern");
    let token = key
        .create_token_at(t0(), HOUR, Some(&pattern))
        .expect("token");
    let fields: Vec<&str> = token.split('.').collect();
    assert_eq!(fields.len(), 5);

    // Longer expiry.
    let later = (t0() + 2 * HOUR)
        .duration_since(UNIX_EPOCH)
        .expect("t")
        .as_secs();
    let extended = format!(
        "{}.{}.{later}.{}.{}",
        fields[0], fields[1], fields[3], fields[4]
    );
    assert!(matches!(
        key.verify_at(&extended, t0()),
        Err(Error::TokenNotAuthentic)
    ));

    // Pattern removed or widened.
    let unbound = format!("{}.{}.{}..{}", fields[0], fields[1], fields[2], fields[4]);
    assert!(matches!(
        key.verify_at(&unbound, t0()),
        Err(Error::TokenNotAuthentic)
    ));
    let wider = format!(
        "{}.{}.{}.{}.{}",
        fields[0],
        fields[1],
        fields[2],
        URL_SAFE_NO_PAD.encode("*"),
        fields[4]
    );
    assert!(matches!(
        key.verify_at(&wider, t0()),
        Err(Error::TokenNotAuthentic)
    ));

    // Another id.
    let other_id = format!(
        "{}.000000000000.{}.{}.{}",
        fields[0], fields[2], fields[3], fields[4]
    );
    assert!(matches!(
        key.verify_at(&other_id, t0()),
        Err(Error::TokenNotAuthentic)
    ));

    // Every single-character change of the MAC.
    let mac_start = token.rfind('.').expect("dot") + 1;
    for i in mac_start..token.len() {
        let mut bytes = token.clone().into_bytes();
        bytes[i] = if bytes[i] == b'A' { b'B' } else { b'A' };
        let altered = String::from_utf8(bytes).expect("ascii");
        if altered == token {
            continue;
        }
        assert!(
            key.verify_at(&altered, t0()).is_err(),
            "altered at {i}: {altered}"
        );
    }
}

#[test]
fn pattern_binding() {
    let key = key();
    let pattern = NamePattern::new("gpu-*.rack12").expect("pattern");
    let token = key
        .create_token_at(t0(), HOUR, Some(&pattern))
        .expect("token");
    let claims = key.verify_at(&token, t0()).expect("valid");
    assert_eq!(claims.name_pattern.as_ref(), Some(&pattern));
    assert!(claims.authorize("gpu-17.rack12").is_ok());
    for refused in [
        "gpu-.rack12",
        "gpu-17.rack13",
        "cpu-1.rack12",
        "gpu-1.x.rack12",
        "gpu-17",
    ] {
        assert!(
            matches!(
                claims.authorize(refused),
                Err(Error::NameNotAllowed { .. }) | Err(Error::InvalidName { .. })
            ),
            "{refused}"
        );
    }
}

#[test]
fn name_patterns() {
    let exact = NamePattern::new("node-1").expect("pattern");
    assert!(exact.matches("node-1"));
    assert!(!exact.matches("node-10"));
    let star = NamePattern::new("*").expect("pattern");
    assert!(star.matches("anything-1"));
    assert!(!star.matches("two.labels"));
    let prefix = NamePattern::new("gpu-*").expect("pattern");
    assert!(prefix.matches("gpu-0"));
    assert!(prefix.matches("gpu-a-b"));
    assert!(!prefix.matches("gpu-"));
    assert!(!prefix.matches("gpu--"), "not a valid name");
    assert!(!prefix.matches("gpu-0.x"));
    let suffix = NamePattern::new("*.rack1").expect("pattern");
    assert!(suffix.matches("n1.rack1"));
    assert!(!suffix.matches(".rack1"));
    assert!(!suffix.matches("a.b.rack1"));
    for bad in ["", "**", "a*b*", "Gpu-*", "*.", "gpu_*", "a..*", "-*"] {
        assert!(NamePattern::new(bad).is_err(), "{bad:?}");
    }
}

#[test]
fn malformed_tokens_are_errors_not_panics() {
    let key = key();
    let good = key.create_token_at(t0(), HOUR, None).expect("token");
    let fields: Vec<&str> = good.split('.').collect();
    let with = |i: usize, v: &str| {
        let mut f = fields.clone();
        f[i] = v;
        f.join(".")
    };
    let long = "a".repeat(5000);
    for bad in [
        String::new(),
        ".".into(),
        "....".into(),
        "stb1".into(),
        format!("{good}.extra"),
        with(0, "stb2"),
        with(1, "ABCDEF012345"),
        with(1, "abc"),
        with(2, ""),
        with(2, "-1"),
        with(2, "0123"),
        with(2, "99999999999999999999999"),
        with(2, "1e9"),
        with(3, "!!"),
        with(4, ""),
        with(4, "AAAA"),
        with(4, "&&&"),
        long,
    ] {
        assert!(
            matches!(
                key.verify_at(&bad, t0()),
                Err(Error::MalformedToken(_)) | Err(Error::TokenNotAuthentic)
            ),
            "{bad:?}"
        );
    }
}

#[test]
fn key_files() {
    let dir = tempfile::tempdir().expect("tempdir");
    let key = key();
    key.save(dir.path()).expect("save");
    let path = dir.path().join(BOOTSTRAP_KEY_FILE);
    assert_eq!(
        std::fs::metadata(&path).expect("stat").permissions().mode() & 0o777,
        0o600
    );
    assert!(matches!(
        key.save(dir.path()),
        Err(Error::AlreadyExists { .. })
    ));
    let loaded = BootstrapKey::load(dir.path()).expect("load");
    let token = key.create_token_at(t0(), HOUR, None).expect("token");
    assert!(loaded.verify_at(&token, t0()).is_ok());
    assert_eq!(format!("{loaded:?}"), "BootstrapKey(<redacted>)");

    std::fs::write(&path, "not hex\n").expect("write");
    assert!(matches!(
        BootstrapKey::load(dir.path()),
        Err(Error::BadInput { .. })
    ));
    std::fs::write(&path, "abcd\n").expect("write");
    assert!(matches!(
        BootstrapKey::load(dir.path()),
        Err(Error::BadInput { .. })
    ));
    assert!(BootstrapKey::from_bytes(&[0u8; 31]).is_err());
    let empty = tempfile::tempdir().expect("tempdir");
    assert!(matches!(
        BootstrapKey::load(empty.path()),
        Err(Error::Io { .. })
    ));
}

#[test]
fn secrets_compare_whole_and_by_length() {
    assert!(crate::secrets_equal(b"abc", b"abc"));
    assert!(!crate::secrets_equal(b"abd", b"abc"));
    assert!(!crate::secrets_equal(b"ab", b"abc"));
    assert!(!crate::secrets_equal(b"", b"abc"));
}
