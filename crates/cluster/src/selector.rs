//! Kubernetes label selectors (the string form used by `kubectl -l`):
//! `a=b`, `a==b`, `a!=b`, `a in (x,y)`, `a notin (x)`, `a` (exists), `!a` (does not
//! exist), comma-separated and ANDed. The empty selector matches everything.

use std::collections::BTreeMap;
use std::fmt;

use crate::error::{Error, Result};

/// One requirement of a selector.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Requirement {
    Equals(String, String),
    NotEquals(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    DoesNotExist(String),
}

impl Requirement {
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        match self {
            Self::Equals(k, v) => labels.get(k) == Some(v),
            Self::NotEquals(k, v) => labels.get(k) != Some(v),
            Self::In(k, vs) => labels.get(k).is_some_and(|l| vs.contains(l)),
            Self::NotIn(k, vs) => labels.get(k).is_none_or(|l| !vs.contains(l)),
            Self::Exists(k) => labels.contains_key(k),
            Self::DoesNotExist(k) => !labels.contains_key(k),
        }
    }
}

/// A parsed selector: all requirements must hold.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Selector {
    pub requirements: Vec<Requirement>,
}

impl Selector {
    pub fn parse(s: &str) -> Result<Self> {
        Parser::new(s).parse()
    }

    /// A selector for `key=value`.
    pub fn equals(key: &str, value: &str) -> Self {
        Self {
            requirements: vec![Requirement::Equals(key.to_owned(), value.to_owned())],
        }
    }

    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.requirements.iter().all(|r| r.matches(labels))
    }

    pub fn is_empty(&self) -> bool {
        self.requirements.is_empty()
    }
}

impl fmt::Display for Selector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, r) in self.requirements.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            match r {
                Requirement::Equals(k, v) => write!(f, "{k}={v}")?,
                Requirement::NotEquals(k, v) => write!(f, "{k}!={v}")?,
                Requirement::In(k, vs) => write!(f, "{k} in ({})", vs.join(","))?,
                Requirement::NotIn(k, vs) => write!(f, "{k} notin ({})", vs.join(","))?,
                Requirement::Exists(k) => write!(f, "{k}")?,
                Requirement::DoesNotExist(k) => write!(f, "!{k}")?,
            }
        }
        Ok(())
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Tok {
    Word(String),
    Eq,
    DoubleEq,
    NotEq,
    Bang,
    Open,
    Close,
    Comma,
}

impl fmt::Display for Tok {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Tok::Word(w) => write!(f, "{w:?}"),
            Tok::Eq => f.write_str("'='"),
            Tok::DoubleEq => f.write_str("'=='"),
            Tok::NotEq => f.write_str("'!='"),
            Tok::Bang => f.write_str("'!'"),
            Tok::Open => f.write_str("'('"),
            Tok::Close => f.write_str("')'"),
            Tok::Comma => f.write_str("','"),
        }
    }
}

struct Parser<'a> {
    src: &'a str,
    toks: Vec<(usize, Tok)>,
    pos: usize,
}

fn is_word_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'/')
}

impl<'a> Parser<'a> {
    fn new(src: &'a str) -> Self {
        Self {
            src,
            toks: Vec::new(),
            pos: 0,
        }
    }

    fn err(&self, position: usize, message: impl Into<String>) -> Error {
        Error::Selector {
            selector: self.src.chars().take(200).collect(),
            position,
            message: message.into(),
        }
    }

    fn lex(&mut self) -> Result<()> {
        let b = self.src.as_bytes();
        let mut i = 0;
        while i < b.len() {
            let c = b[i];
            let start = i;
            let tok = match c {
                b' ' | b'\t' | b'\n' | b'\r' => {
                    i += 1;
                    continue;
                }
                b'=' if b.get(i + 1) == Some(&b'=') => {
                    i += 2;
                    Tok::DoubleEq
                }
                b'=' => {
                    i += 1;
                    Tok::Eq
                }
                b'!' if b.get(i + 1) == Some(&b'=') => {
                    i += 2;
                    Tok::NotEq
                }
                b'!' => {
                    i += 1;
                    Tok::Bang
                }
                b'(' => {
                    i += 1;
                    Tok::Open
                }
                b')' => {
                    i += 1;
                    Tok::Close
                }
                b',' => {
                    i += 1;
                    Tok::Comma
                }
                c if is_word_byte(c) => {
                    while i < b.len() && is_word_byte(b[i]) {
                        i += 1;
                    }
                    Tok::Word(self.src[start..i].to_owned())
                }
                _ => {
                    let ch = self.src[i..].chars().next().unwrap_or('?');
                    return Err(self.err(i, format!("unexpected character {ch:?}")));
                }
            };
            self.toks.push((start, tok));
        }
        Ok(())
    }

    fn peek(&self) -> Option<&Tok> {
        self.toks.get(self.pos).map(|(_, t)| t)
    }

    fn here(&self) -> usize {
        self.toks
            .get(self.pos)
            .map(|(p, _)| *p)
            .unwrap_or(self.src.len())
    }

    fn next(&mut self) -> Option<Tok> {
        let t = self.toks.get(self.pos).map(|(_, t)| t.clone());
        self.pos += 1;
        t
    }

    fn parse(mut self) -> Result<Selector> {
        self.lex()?;
        let mut requirements = Vec::new();
        if self.toks.is_empty() {
            return Ok(Selector { requirements });
        }
        loop {
            requirements.push(self.requirement()?);
            match self.next() {
                None => break,
                Some(Tok::Comma) => {
                    if self.peek().is_none() {
                        return Err(self.err(self.src.len(), "trailing ','"));
                    }
                }
                Some(t) => {
                    return Err(self.err(
                        self.toks[self.pos - 1].0,
                        format!("expected ',' or end of selector, found {t}"),
                    ))
                }
            }
        }
        Ok(Selector { requirements })
    }

    fn key(&mut self) -> Result<String> {
        let at = self.here();
        match self.next() {
            Some(Tok::Word(w)) => {
                validate_key(&w).map_err(|e| self.err(at, e.to_string()))?;
                Ok(w)
            }
            Some(t) => Err(self.err(at, format!("expected a label key, found {t}"))),
            None => Err(self.err(at, "expected a label key, found end of selector")),
        }
    }

    fn value(&mut self) -> Result<String> {
        let at = self.here();
        match self.peek() {
            Some(Tok::Word(w)) => {
                let w = w.clone();
                validate_value(&w).map_err(|e| self.err(at, e.to_string()))?;
                self.pos += 1;
                Ok(w)
            }
            // `a=` selects the empty value, as in Kubernetes.
            None | Some(Tok::Comma) | Some(Tok::Close) => Ok(String::new()),
            Some(t) => Err(self.err(at, format!("expected a label value, found {t}"))),
        }
    }

    fn set(&mut self) -> Result<Vec<String>> {
        let at = self.here();
        if self.next() != Some(Tok::Open) {
            return Err(self.err(at, "expected '(' after in/notin"));
        }
        let mut vals = Vec::new();
        loop {
            let v = self.value()?;
            vals.push(v);
            let at = self.here();
            match self.next() {
                Some(Tok::Comma) => continue,
                Some(Tok::Close) => break,
                Some(t) => return Err(self.err(at, format!("expected ',' or ')', found {t}"))),
                None => return Err(self.err(at, "unclosed '(' in value set")),
            }
        }
        Ok(vals)
    }

    fn requirement(&mut self) -> Result<Requirement> {
        if self.peek() == Some(&Tok::Bang) {
            self.pos += 1;
            return Ok(Requirement::DoesNotExist(self.key()?));
        }
        let key = self.key()?;
        let at = self.here();
        match self.peek().cloned() {
            None | Some(Tok::Comma) => Ok(Requirement::Exists(key)),
            Some(Tok::Eq) | Some(Tok::DoubleEq) => {
                self.pos += 1;
                Ok(Requirement::Equals(key, self.value()?))
            }
            Some(Tok::NotEq) => {
                self.pos += 1;
                Ok(Requirement::NotEquals(key, self.value()?))
            }
            Some(Tok::Word(w)) if w == "in" => {
                self.pos += 1;
                Ok(Requirement::In(key, self.set()?))
            }
            Some(Tok::Word(w)) if w == "notin" => {
                self.pos += 1;
                Ok(Requirement::NotIn(key, self.set()?))
            }
            Some(t) => Err(self.err(
                at,
                format!("expected an operator (=, ==, !=, in, notin), ',' or end after key {key:?}, found {t}"),
            )),
        }
    }
}

fn valid_name(s: &str, max: usize) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= max
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
}

fn valid_dns_subdomain(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|p| {
            let b = p.as_bytes();
            !b.is_empty()
                && b.len() <= 63
                && b[0].is_ascii_alphanumeric()
                && b[b.len() - 1].is_ascii_alphanumeric()
                && b.iter()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        })
}

/// Label keys: `[prefix/]name`, name ≤ 63 chars of `[A-Za-z0-9._-]` starting and
/// ending alphanumeric, prefix a DNS subdomain.
pub fn validate_key(k: &str) -> Result<()> {
    let (prefix, name) = match k.split_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, k),
    };
    if let Some(p) = prefix {
        if !valid_dns_subdomain(p) {
            return Err(Error::InvalidLabel(format!(
                "label key prefix {p:?} is not a DNS subdomain"
            )));
        }
    }
    if !valid_name(name, 63) {
        return Err(Error::InvalidLabel(format!(
            "label key {k:?}: name must be 1-63 characters of [A-Za-z0-9._-], starting and ending with an alphanumeric"
        )));
    }
    Ok(())
}

/// Label values: empty, or ≤ 63 chars of `[A-Za-z0-9._-]` starting and ending alphanumeric.
pub fn validate_value(v: &str) -> Result<()> {
    if v.is_empty() || valid_name(v, 63) {
        Ok(())
    } else {
        Err(Error::InvalidLabel(format!(
            "label value {v:?} must be at most 63 characters of [A-Za-z0-9._-], starting and ending with an alphanumeric"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn parses_every_operator() {
        let s = Selector::parse(
            "zone=a, rack==r1,pool!=cpu,gpu in (h100, a100),tier notin (spot),starling.io/warm,!cordoned",
        )
        .expect("parses");
        assert_eq!(
            s.requirements,
            vec![
                Requirement::Equals("zone".into(), "a".into()),
                Requirement::Equals("rack".into(), "r1".into()),
                Requirement::NotEquals("pool".into(), "cpu".into()),
                Requirement::In("gpu".into(), vec!["h100".into(), "a100".into()]),
                Requirement::NotIn("tier".into(), vec!["spot".into()]),
                Requirement::Exists("starling.io/warm".into()),
                Requirement::DoesNotExist("cordoned".into()),
            ]
        );
        assert_eq!(
            s.to_string(),
            "zone=a,rack=r1,pool!=cpu,gpu in (h100,a100),tier notin (spot),starling.io/warm,!cordoned"
        );
    }

    #[test]
    fn matching_follows_kubernetes_semantics() {
        let n = labels(&[("zone", "a"), ("gpu", "h100")]);
        let m = |s: &str| Selector::parse(s).expect("parses").matches(&n);
        assert!(m(""));
        assert!(m("zone=a"));
        assert!(!m("zone=b"));
        assert!(m("zone!=b"));
        assert!(m("rack!=r1"), "!= matches an absent label");
        assert!(m("gpu in (a100,h100)"));
        assert!(!m("rack in (r1)"), "in needs the label");
        assert!(m("rack notin (r1)"), "notin matches an absent label");
        assert!(!m("gpu notin (h100)"));
        assert!(m("gpu"));
        assert!(!m("rack"));
        assert!(m("!rack"));
        assert!(!m("!gpu"));
        assert!(!m("zone=a,gpu=a100"), "requirements are ANDed");
        assert!(!m("zone="), "an empty value is a value");
    }

    #[test]
    fn empty_value_is_allowed() {
        let s = Selector::parse("zone=").expect("parses");
        assert_eq!(
            s.requirements,
            vec![Requirement::Equals("zone".into(), "".into())]
        );
        assert!(s.matches(&labels(&[("zone", "")])));
        assert!(!s.matches(&labels(&[("zone", "a")])));
    }

    #[test]
    fn malformed_selectors_have_clear_errors() {
        let cases: &[(&str, usize, &str)] = &[
            ("zone=a,", 7, "trailing ','"),
            ("zone in a", 8, "expected '(' after in/notin"),
            ("zone in (a,b", 12, "unclosed '(' in value set"),
            ("=a", 0, "expected a label key, found '='"),
            (
                "zone=a b",
                7,
                "expected ',' or end of selector, found \"b\"",
            ),
            ("zone~a", 4, "unexpected character '~'"),
            ("-zone=a", 0, "label key \"-zone\": name must be"),
            (
                "Bad_Prefix/zone=a",
                0,
                "label key prefix \"Bad_Prefix\" is not a DNS subdomain",
            ),
            ("zone=-a", 5, "label value \"-a\" must be"),
            ("zone >a", 5, "unexpected character '>'"),
            ("zone a", 5, "expected an operator"),
            ("!", 1, "expected a label key, found end of selector"),
        ];
        for (input, pos, msg) in cases {
            match Selector::parse(input) {
                Err(Error::Selector {
                    selector,
                    position,
                    message,
                }) => {
                    assert_eq!(&selector, input);
                    assert_eq!(position, *pos, "{input}: {message}");
                    assert!(message.starts_with(msg), "{input}: got {message:?}");
                }
                other => panic!("{input}: expected a selector error, got {other:?}"),
            }
        }
    }
}
