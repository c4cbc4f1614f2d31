//! Scraping a `--metrics` endpoint the way Prometheus does (one GET over a
//! fresh connection), and a strict reader of the text format (0.0.4): every
//! line is a `# HELP`, a `# TYPE` or a sample `name{labels} value`; every
//! sample belongs to the family declared just before it, with both its HELP
//! and TYPE lines; histogram buckets are cumulative and end with `+Inf`
//! equal to `_count`.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};

use super::BOUND;

/// The status line, headers (lower-cased names) and body of one answer.
pub struct Answer {
    pub status: String,
    pub headers: BTreeMap<String, String>,
    pub body: String,
}

/// Sends `request` as it is on a new connection and reads the answer up
/// to the server's close.
pub fn exchange(addr: SocketAddr, request: &[u8]) -> Answer {
    let mut s = TcpStream::connect(addr).unwrap();
    exchange_on(&mut s, request)
}

/// Like [`exchange`], on a connection the caller made.
pub fn exchange_on(s: &mut TcpStream, request: &[u8]) -> Answer {
    s.set_read_timeout(Some(BOUND)).unwrap();
    s.write_all(request).unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    parse_answer(&raw)
}

pub fn parse_answer(raw: &[u8]) -> Answer {
    let text = String::from_utf8(raw.to_vec()).expect("an answer in UTF-8");
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or_else(|| panic!("no end of head in {text:?}"));
    let mut lines = head.split("\r\n");
    let status = lines.next().unwrap().to_owned();
    let headers = lines
        .map(|l| {
            let (name, value) = l.split_once(':').unwrap_or_else(|| panic!("bad header {l:?}"));
            (name.trim().to_ascii_lowercase(), value.trim().to_owned())
        })
        .collect();
    Answer { status, headers, body: body.to_owned() }
}

/// `GET /metrics`: the exposition, checked (200, its content type and
/// length, and [`Exposition::parse`]).
pub fn scrape(addr: SocketAddr) -> Exposition {
    let answer = exchange(addr, b"GET /metrics HTTP/1.1\r\nHost: kvlink\r\nAccept: text/plain\r\n\r\n");
    assert_eq!(answer.status, "HTTP/1.1 200 OK", "{}", answer.body);
    assert_eq!(answer.headers["content-type"], "text/plain; version=0.0.4; charset=utf-8");
    assert_eq!(answer.headers["content-length"], answer.body.len().to_string());
    Exposition::parse(&answer.body)
}

/// The address in a `metrics on http://ADDR/metrics` line.
pub fn metrics_addr(line: &str) -> SocketAddr {
    line.split("http://")
        .nth(1)
        .and_then(|rest| rest.strip_suffix("/metrics"))
        .and_then(|addr| addr.trim().parse().ok())
        .unwrap_or_else(|| panic!("no metrics address in {line:?}"))
}

/// A sample's labels other than `le`, in order.
type Labels = Vec<(String, String)>;

/// One sample line.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

impl Sample {
    fn has(&self, labels: &[(&str, &str)]) -> bool {
        labels.iter().all(|(k, v)| self.labels.get(*k).map(String::as_str) == Some(*v))
    }
}

/// A parsed and checked exposition.
#[derive(Debug)]
pub struct Exposition {
    pub samples: Vec<Sample>,
    /// Family name → its TYPE.
    pub types: BTreeMap<String, String>,
}

impl Exposition {
    /// Parses `text`, panicking at the first line that breaks the format.
    pub fn parse(text: &str) -> Self {
        let mut helps = BTreeMap::new();
        let mut types: BTreeMap<String, String> = BTreeMap::new();
        let mut samples = Vec::new();
        let mut current: Option<String> = None;
        for (n, line) in text.lines().enumerate() {
            let at = || format!("line {}: {line:?}", n + 1);
            if let Some(rest) = line.strip_prefix("# HELP ") {
                let (name, help) = rest.split_once(' ').unwrap_or_else(|| panic!("{}", at()));
                assert!(valid_name(name) && !help.is_empty(), "{}", at());
                assert!(helps.insert(name.to_owned(), help.to_owned()).is_none(), "HELP twice, {}", at());
            } else if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').unwrap_or_else(|| panic!("{}", at()));
                assert!(valid_name(name), "{}", at());
                assert!(["counter", "gauge", "histogram", "summary", "untyped"].contains(&kind), "{}", at());
                assert!(helps.contains_key(name), "TYPE before its HELP, {}", at());
                assert!(types.insert(name.to_owned(), kind.to_owned()).is_none(), "TYPE twice, {}", at());
                current = Some(name.to_owned());
            } else if line.starts_with('#') || line.is_empty() {
                panic!("unexpected {}", at());
            } else {
                let sample = parse_sample(line).unwrap_or_else(|| panic!("not a sample, {}", at()));
                let family = current.as_deref().unwrap_or_else(|| panic!("sample before any TYPE, {}", at()));
                let ok = match types[family].as_str() {
                    "histogram" => ["_bucket", "_sum", "_count"].iter().any(|s| sample.name == format!("{family}{s}")),
                    _ => sample.name == family,
                };
                assert!(ok, "sample outside its family {family}, {}", at());
                samples.push(sample);
            }
        }
        let exposition = Self { samples, types };
        exposition.check_histograms();
        exposition
    }

    /// Every histogram's buckets are cumulative, in ascending `le`, the last
    /// `+Inf` and equal to `_count`.
    fn check_histograms(&self) {
        for (family, kind) in &self.types {
            if kind != "histogram" {
                continue;
            }
            let bucket = format!("{family}_bucket");
            let mut series: BTreeMap<Labels, Vec<(f64, f64)>> = BTreeMap::new();
            for s in self.samples.iter().filter(|s| s.name == bucket) {
                let le = s.labels.get("le").unwrap_or_else(|| panic!("{s:?} has no le"));
                let le: f64 = if le == "+Inf" { f64::INFINITY } else { le.parse().unwrap() };
                let key = s.labels.iter().filter(|(k, _)| *k != "le").map(|(k, v)| (k.clone(), v.clone())).collect();
                series.entry(key).or_default().push((le, s.value));
            }
            assert!(!series.is_empty() || !self.samples.iter().any(|s| s.name.starts_with(family.as_str())));
            for (labels, buckets) in series {
                assert!(
                    buckets.windows(2).all(|w| w[0].0 < w[1].0 && w[0].1 <= w[1].1),
                    "{family} {labels:?}: {buckets:?}"
                );
                let (le, inf) = *buckets.last().unwrap();
                assert_eq!(le, f64::INFINITY, "{family} {labels:?}: no +Inf bucket");
                let labels: Vec<(&str, &str)> = labels.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
                assert_eq!(self.one(&format!("{family}_count"), &labels), inf, "{family} {labels:?}: +Inf != _count");
                self.one(&format!("{family}_sum"), &labels);
            }
        }
    }

    /// The samples named `name` carrying every label of `labels`.
    pub fn matching<'a>(&'a self, name: &'a str, labels: &'a [(&'a str, &'a str)]) -> impl Iterator<Item = &'a Sample> {
        self.samples.iter().filter(move |s| s.name == name && s.has(labels))
    }

    /// The one sample named `name` with exactly `labels` (panics otherwise).
    pub fn one(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let found: Vec<&Sample> = self.matching(name, labels).filter(|s| s.labels.len() == labels.len()).collect();
        assert_eq!(found.len(), 1, "{name} {labels:?}: {found:?}");
        found[0].value
    }

    /// The sum over the samples named `name` carrying `labels`.
    pub fn sum(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.matching(name, labels).map(|s| s.value).sum()
    }

    /// The samples of `name` with `labels` that are not 0, by the value of
    /// label `by`.
    pub fn nonzero_by(&self, name: &str, labels: &[(&str, &str)], by: &str) -> BTreeMap<String, f64> {
        self.matching(name, labels)
            .filter(|s| s.value != 0.0)
            .map(|s| (s.labels.get(by).cloned().unwrap_or_default(), s.value))
            .collect()
    }
}

fn valid_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

fn parse_sample(line: &str) -> Option<Sample> {
    let name_end = line.find(['{', ' '])?;
    let name = &line[..name_end];
    if !valid_name(name) {
        return None;
    }
    let mut rest = &line[name_end..];
    let mut labels = BTreeMap::new();
    if let Some(mut inner) = rest.strip_prefix('{') {
        loop {
            if let Some(after) = inner.strip_prefix('}') {
                rest = after;
                break;
            }
            let (key, after) = inner.split_once("=\"")?;
            if !valid_name(key) || key.contains(':') {
                return None;
            }
            let mut value = String::new();
            let mut chars = after.char_indices();
            let end = loop {
                match chars.next()? {
                    (i, '"') => break i + 1,
                    (_, '\\') => match chars.next()?.1 {
                        'n' => value.push('\n'),
                        c @ ('\\' | '"') => value.push(c),
                        _ => return None,
                    },
                    (_, c) => value.push(c),
                }
            };
            if labels.insert(key.to_owned(), value).is_some() {
                return None;
            }
            inner = &after[end..];
            if let Some(next) = inner.strip_prefix(',') {
                inner = next;
            } else if !inner.starts_with('}') {
                return None;
            }
        }
    }
    let value = rest.strip_prefix(' ')?;
    if value.contains(' ') {
        return None; // no timestamps are written
    }
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().ok()?,
    };
    Some(Sample { name: name.to_owned(), labels, value })
}
