//! One request followed through both instances' logs: with the filter the
//! README documents for `KVLINK_LOG`, D's pull and P's serve each log the
//! request under both its ids, inside a span naming the same grant.
#![cfg(feature = "tcp")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use kv_proto::KvRole;
use test_support::Logs;

/// The `KVLINK_LOG` value README.md gives for following transfers.
const FOLLOW_TRANSFERS: &str = "warn,kv_worker[pull]=debug,kv_worker[serve]=debug";

/// The value of `field=` in `line`, up to the next space, comma or brace.
fn field<'a>(line: &'a str, field: &str) -> Option<&'a str> {
    let start = line.find(&format!("{field}="))? + field.len() + 1;
    let rest = &line[start..];
    Some(&rest[..rest.find([' ', '}', ':', ',']).unwrap_or(rest.len())])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_is_followed_from_ds_pull_to_ps_write_by_its_grant() {
    let readme = include_str!("../../../README.md");
    assert!(readme.contains(FOLLOW_TRANSFERS), "README documents the filter this test uses");
    let logs = Logs::install_filter(FOLLOW_TRANSFERS);
    let net = Net::new(Backend::Tcp).unwrap();
    let p = start(net.config(KvRole::Producer, "p"), net.writer(KvRole::Producer, "p").await).await;
    let d = start(net.config(KvRole::Consumer, "d"), net.writer(KvRole::Consumer, "d").await).await;
    let (host, port) = side_channel(&p);
    fill(&p.cache, 7, &[0, 1]);
    ready(&p, "a", &[0, 1]);
    pull(&d, &host, port, &[("a", &[4, 5])]);
    until(&d.worker, |f| f.receiving.len() == 1).await;
    until(&p.worker, |f| f.sending.len() == 1).await;

    let text = logs.text();
    let received = text.lines().find(|l| l.contains("pull{") && l.contains("KV received")).expect(&text);
    let grant = field(received, "grant").expect(received);
    assert_eq!(field(received, "req_id"), Some("a"), "{received}");
    assert_eq!(field(received, "remote_req_id"), Some("p-a"), "{received}");
    let served = text.lines().find(|l| l.contains("serve{") && l.contains("serving")).expect(&text);
    assert_eq!(field(served, "grant"), Some(grant), "P's span names D's grant: {served}");
    assert_eq!(field(served, "req_id"), Some("p-a"), "{served}");
    assert_eq!(field(served, "decode_req_id"), Some("a"), "{served}");
    assert!(
        text.lines().any(|l| l.contains("serve{") && l.contains("batch written") && l.contains(grant)),
        "P's write is in the same span: {text}"
    );
    // Debug lines come from inside transfers only, not from everything.
    let stray: Vec<&str> =
        text.lines().filter(|l| l.contains("DEBUG") && !l.contains("pull{") && !l.contains("serve{")).collect();
    assert!(stray.is_empty(), "{stray:#?}");
}
