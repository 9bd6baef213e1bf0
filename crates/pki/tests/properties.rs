//! Property tests: the token parser and the name grammar never panic, and what is valid
//! round-trips.
#![allow(clippy::unwrap_used)] // a test that unwraps reports its failure by panicking

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use pki::{BootstrapKey, CaPin, Error, Identity, NamePattern, Role, MAX_TOKEN_TTL};
use proptest::prelude::*;

/// An independent statement of the grammar (a regex plus the length bound), to check
/// `validate_name` against.
fn oracle(name: &str) -> bool {
    let label = "[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?";
    let re = regex::Regex::new(&format!("^{label}(\\.{label})*$")).expect("regex");
    name.len() <= 253 && re.is_match(name)
}

fn label() -> impl Strategy<Value = String> {
    "[a-z0-9]([a-z0-9-]{0,20}[a-z0-9])?"
}

fn valid_name() -> impl Strategy<Value = String> {
    prop::collection::vec(label(), 1..5).prop_map(|labels| labels.join("."))
}

fn role() -> impl Strategy<Value = Role> {
    prop::sample::select(Role::ALL.to_vec())
}

fn t0() -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(1_800_000_000)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn validate_name_agrees_with_the_oracle(name in "[a-z0-9.A-Z_*:-]{0,70}") {
        prop_assert_eq!(pki::validate_name(&name).is_ok(), oracle(&name), "{:?}", name);
    }

    #[test]
    fn validate_name_never_panics(name in any::<String>()) {
        let ok = pki::validate_name(&name).is_ok();
        prop_assert_eq!(ok, oracle(&name));
    }

    #[test]
    fn long_names_follow_the_length_rules(labels in prop::collection::vec("[a-z]{1,70}", 1..8)) {
        let name = labels.join(".");
        prop_assert_eq!(pki::validate_name(&name).is_ok(), oracle(&name));
    }

    #[test]
    fn identities_round_trip(role in role(), name in valid_name()) {
        let id = Identity::new(role, name.clone()).expect("valid name");
        let uri = id.to_uri();
        let back: Identity = uri.parse().expect("parses");
        prop_assert_eq!(back.name(), name.as_str());
        prop_assert_eq!(back, id);
    }

    #[test]
    fn identity_parser_never_panics(text in any::<String>()) {
        let _ = Identity::parse_uri(&text);
        let _ = text.parse::<CaPin>();
        let _ = NamePattern::new(&text);
    }

    #[test]
    fn identity_parser_on_near_misses(text in "(starling|STARLING|x)?:?(node|viewer|admin)?:?[a-zA-Z0-9.:-]{0,12}") {
        if let Ok(id) = Identity::parse_uri(&text) {
            prop_assert_eq!(id.to_uri(), text);
        }
    }

    #[test]
    fn tokens_round_trip(
        ttl_secs in 1..=MAX_TOKEN_TTL.as_secs(),
        name in valid_name(),
        star in any::<bool>(),
    ) {
        let key = BootstrapKey::from_bytes(&[7u8; 32]).expect("key");
        // Bind either to the exact name or to its first label with a `*` for the rest
        // of it, when that first label is long enough to leave a prefix.
        let pattern_text = match name.split_once('.') {
            Some((first, rest)) if star && first.len() > 1 => {
                format!("{}*.{rest}", &first[..1])
            }
            _ => name.clone(),
        };
        let pattern = NamePattern::new(&pattern_text).expect("pattern");
        let token = key
            .create_token_at(t0(), Duration::from_secs(ttl_secs), Some(&pattern))
            .expect("token");
        let claims = key.verify_at(&token, t0()).expect("valid");
        prop_assert_eq!(claims.expires_at, t0() + Duration::from_secs(ttl_secs));
        prop_assert_eq!(claims.name_pattern.as_ref(), Some(&pattern));
        prop_assert_eq!(claims.authorize(&name).expect("authorized"), Identity::node(&name).expect("name"));
        let expired = key.verify_at(&token, t0() + Duration::from_secs(ttl_secs + 1));
        prop_assert!(
            matches!(expired, Err(Error::TokenExpired { .. })),
            "expired token verified: {:?}",
            expired
        );
    }

    #[test]
    fn token_parser_never_panics(text in any::<String>()) {
        let key = BootstrapKey::from_bytes(&[7u8; 32]).expect("key");
        prop_assert!(key.verify_at(&text, t0()).is_err());
    }

    #[test]
    fn token_parser_on_token_shaped_input(
        version in "(stb1|stb2|)",
        id in "[0-9a-fA-F]{0,14}",
        expiry in "[0-9-]{0,22}",
        pattern in "[A-Za-z0-9_=-]{0,12}",
        mac in "[A-Za-z0-9_=+/-]{0,50}",
    ) {
        let key = BootstrapKey::from_bytes(&[7u8; 32]).expect("key");
        let text = format!("{version}.{id}.{expiry}.{pattern}.{mac}");
        // Without the key nobody produces a valid MAC by chance.
        prop_assert!(key.verify_at(&text, t0()).is_err());
    }

    #[test]
    fn any_single_byte_change_breaks_a_token(pos in any::<prop::sample::Index>(), byte in 0x21u8..0x7f) {
        let key = BootstrapKey::from_bytes(&[7u8; 32]).expect("key");
        let pattern = NamePattern::new("gpu-*").expect("pattern");
        let token = key
            .create_token_at(t0(), Duration::from_secs(3600), Some(&pattern))
            .expect("token");
        let mut bytes = token.clone().into_bytes();
        let i = pos.index(bytes.len());
        prop_assume!(bytes[i] != byte);
        bytes[i] = byte;
        let altered = String::from_utf8(bytes).expect("ascii");
        prop_assert!(key.verify_at(&altered, t0()).is_err(), "{} accepted", altered);
    }
}
