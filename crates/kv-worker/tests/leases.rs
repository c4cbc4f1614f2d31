//! Short leases, decided with explicit time: a decode instance renews P's
//! hold on the requests it has seen and will pull (`RenewalSchedule` over
//! its `WatchList`), P holds a renewed request a renewal past the last one
//! (`SenderCore`) and, while it makes that instance's messages wait for
//! admission, renews on its behalf (`AdmissionWait`). Driven together here
//! through whole scenarios — a decode instance that lives, dies, is slow,
//! cannot reach P, or is kept waiting by P — so P frees a request whose
//! decode instance died within a renewal period instead of the abort
//! timeout, and never frees one a live decode instance still wants. That
//! the real workers wire these together is `leases_end_to_end.rs`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use kv_proto::{EngineId, RemotePrefill, RenewalKey, Renewing, ReqId, SendUpdate};
use kv_worker::serving::{AdmissionWait, MIN_RENEW_INTERVAL};
use kv_worker::{RenewalSchedule, Renewed, SenderCore, SideChannelAddr, WatchList};
use rstest::rstest;

fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s)
}

/// P's side channel `host:9000`, as D's watch list names it (rank 0).
fn prefill(host: &str) -> SideChannelAddr {
    SideChannelAddr { host: host.to_owned(), port: 9000 }
}

/// The renewal key P gave every request of these tests.
const KEY: RenewalKey = RenewalKey::from_bytes([0x6b; 16]);

/// A renewal of P's request `p_req`, naming its key.
fn renewing(p_req: &str) -> Renewing {
    Renewing { req_id: ReqId::new(p_req), key: KEY }
}

/// D watches its request `req` of P's request `p-req` on `host`.
fn watch(watches: &mut WatchList, req: &str, host: &str) {
    let remote = RemotePrefill {
        remote_host: host.to_owned(),
        remote_port: 9000,
        remote_request_id: ReqId::new(format!("p-{req}")),
        remote_engine_id: None,
        remote_renewal_key: Some(KEY),
        bootstrap: None,
    };
    watches.watch(&ReqId::new(req), &remote, vec![prefill(host)]);
}

/// One step of D's renewal schedule, at a time in seconds.
#[derive(Clone, Copy, Debug)]
enum Step {
    /// D starts watching its request on a prefill host.
    Watch(&'static str, &'static str),
    /// D stops watching its request.
    Unwatch(&'static str),
    /// The prefill hosts due a renewal now (and from now under way).
    Due(f64, &'static [&'static str]),
    /// The renewal on a prefill host ended.
    Done(f64, &'static str, Renewed),
    /// When the schedule wakes its driver next (`None`: never).
    Wakes(Option<f64>),
}

const HELD: Renewed = Renewed::Held(Duration::from_secs(3));
const P_TAKES_NONE: Renewed = Renewed::Held(Duration::ZERO);

/// When D renews on each prefill worker: at once for a new one, a third of
/// P's renewal period after the last renewal (at most every
/// `MIN_RENEW_INTERVAL`), a second after a failed one,
/// a minute after a P that takes none; never twice at once; a prefill
/// worker with nothing watched any more is forgotten.
#[rstest]
#[case::a_first_watch_is_due_at_once(&[Step::Watch("a", "p1"), Step::Due(0.0, &["p1"])])]
#[case::one_renewal_per_prefill_worker(&[Step::Watch("a", "p1"), Step::Watch("b", "p1"), Step::Watch("c", "p2"), Step::Due(0.0, &["p1", "p2"])])]
#[case::next_a_third_of_ps_period_later(&[Step::Watch("a", "p1"), Step::Due(0.0, &["p1"]), Step::Done(0.5, "p1", HELD), Step::Wakes(Some(1.5)), Step::Due(1.499, &[]), Step::Due(1.5, &["p1"])])]
// P announces its period in its hello: one of a microsecond would have D
// renew in a loop.
#[case::not_more_often_than_the_minimum(&[Step::Watch("a", "p1"), Step::Due(0.0, &["p1"]), Step::Done(0.0, "p1", Renewed::Held(Duration::from_micros(1))), Step::Wakes(Some(0.1)), Step::Due(0.099, &[]), Step::Due(0.1, &["p1"])])]
#[case::a_failed_renewal_is_retried_after_a_second(&[Step::Watch("a", "p1"), Step::Due(0.0, &["p1"]), Step::Done(2.0, "p1", Renewed::Failed), Step::Wakes(Some(3.0)), Step::Due(2.999, &[]), Step::Due(3.0, &["p1"])])]
#[case::a_p_that_takes_none_is_asked_again_after_a_minute(&[Step::Watch("a", "p1"), Step::Due(0.0, &["p1"]), Step::Done(0.0, "p1", P_TAKES_NONE), Step::Wakes(Some(60.0)), Step::Due(59.0, &[]), Step::Due(60.0, &["p1"])])]
// The renewal under way is neither due again nor a reason to wake (the
// driver used to wake at once, over and over, until it ended).
#[case::one_under_way_is_not_due_again_and_wakes_nothing(&[Step::Watch("a", "p1"), Step::Due(0.0, &["p1"]), Step::Done(0.0, "p1", HELD), Step::Due(1.0, &["p1"]), Step::Wakes(None), Step::Due(100.0, &[]), Step::Done(100.0, "p1", HELD), Step::Wakes(Some(101.0))])]
#[case::a_prefill_worker_watched_again_is_due_at_once(&[Step::Watch("a", "p1"), Step::Due(0.0, &["p1"]), Step::Done(0.0, "p1", HELD), Step::Unwatch("a"), Step::Due(0.5, &[]), Step::Wakes(None), Step::Watch("b", "p1"), Step::Due(0.5, &["p1"])])]
#[case::each_prefill_worker_on_its_own_clock(&[Step::Watch("a", "p1"), Step::Watch("b", "p2"), Step::Due(0.0, &["p1", "p2"]), Step::Done(0.0, "p1", HELD), Step::Done(0.0, "p2", Renewed::Failed), Step::Wakes(Some(1.0)), Step::Due(1.0, &["p1", "p2"]), Step::Done(1.0, "p2", HELD), Step::Wakes(Some(2.0))])]
fn renewal_schedule(#[case] steps: &[Step]) {
    let t0 = Instant::now();
    let mut watches = WatchList::new();
    let mut schedule = RenewalSchedule::new();
    for (i, step) in steps.iter().enumerate() {
        match *step {
            Step::Watch(req, host) => watch(&mut watches, req, host),
            Step::Unwatch(req) => watches.unwatch(&ReqId::new(req)),
            Step::Due(at, hosts) => {
                let due: Vec<SideChannelAddr> =
                    schedule.poll_due(&watches, t0 + secs(at)).into_iter().map(|(peer, _)| peer).collect();
                let expected: Vec<SideChannelAddr> = hosts.iter().map(|h| prefill(h)).collect();
                assert_eq!(due, expected, "step {i}: {step:?}");
            }
            Step::Done(at, host, renewed) => schedule.handle_done(&prefill(host), renewed, t0 + secs(at)),
            Step::Wakes(at) => assert_eq!(schedule.poll_timeout(), at.map(|s| t0 + secs(s)), "step {i}: {step:?}"),
        }
    }
}

/// A renewal names P's ids of every request watched on that prefill
/// worker, each with its renewal key.
#[test]
fn a_renewal_names_ps_ids_of_the_watched_requests() {
    let mut watches = WatchList::new();
    watch(&mut watches, "a", "p1");
    watch(&mut watches, "b", "p1");
    let due = RenewalSchedule::new().poll_due(&watches, Instant::now());
    assert_eq!(due, [(prefill("p1"), vec![renewing("p-a"), renewing("p-b")])]);
}

/// While P makes a decode instance wait, it renews on its behalf every
/// third of its renewal period (at most every `MIN_RENEW_INTERVAL`), and
/// never when renewals are off.
#[rstest]
#[case::a_third_of_the_period(secs(3.0), &[(0.999, 0), (1.0, 1), (1.5, 0), (2.0, 1), (3.5, 1)], Some(4.5))]
#[case::not_more_often_than_the_minimum(secs(0.15), &[(0.05, 0), (0.1, 1), (0.15, 0), (0.2, 1)], Some(0.3))]
#[case::never_with_renewals_off(Duration::ZERO, &[(0.0, 0), (100.0, 0)], None)]
fn admission_wait_renews_on_the_decode_instances_behalf(
    #[case] renewal: Duration,
    #[case] ticks: &[(f64, usize)],
    #[case] next: Option<f64>,
) {
    let t0 = Instant::now();
    let d = EngineId::new("d");
    let mut sender = SenderCore::new(secs(3600.0), renewal);
    sender.handle_update(&ReqId::new("r"), &SendUpdate::Ready { block_ids: vec![1] }, t0);
    sender.set_renewal_key(&ReqId::new("r"), KEY);
    sender.renew(&[renewing("r")], &d, t0);
    let mut waiting = AdmissionWait::new(d, renewal, t0);
    for &(at, renewed) in ticks {
        assert_eq!(waiting.handle_timeout(&mut sender, t0 + secs(at)), renewed, "at {at} s");
    }
    assert_eq!(waiting.poll_timeout(), next.map(|s| t0 + secs(s)));
    assert!(MIN_RENEW_INTERVAL <= secs(0.1));
}

/// One watched request, a decode instance and its prefill worker, all in
/// seconds from 0, when the request became ready on P.
#[derive(Clone, Copy, Debug)]
struct World {
    /// P's renewal period (zero: P takes no renewals).
    renewal: f64,
    /// P's abort timeout: the hold of a request no one renews.
    lease: f64,
    /// How late D's renewals reach P.
    latency: f64,
    /// D dies here (sends nothing from then on).
    d_dies_at: Option<f64>,
    /// D's renewals fail from..to (P unreachable).
    unreachable: Option<(f64, f64)>,
    /// P makes D's messages wait from..to (a transfer request of D's waits
    /// for admission; D's renewals wait unread behind it).
    stalled: Option<(f64, f64)>,
}

const WORLD: World =
    World { renewal: 3.0, lease: 3600.0, latency: 0.0, d_dies_at: None, unreachable: None, stalled: None };

fn within(span: Option<(f64, f64)>, at: f64) -> bool {
    span.is_some_and(|(from, to)| from <= at && at < to)
}

/// Runs `world` until P frees the request or `horizon` passes; returns when
/// P freed it. Every core gets the time of the event it hears of: D's
/// schedule when a renewal is due or ends, P's sender when a renewal
/// arrives and at each of its own deadlines, the admission wait at its.
fn simulate(world: World, horizon: f64) -> Option<f64> {
    let t0 = Instant::now();
    let at = |s: f64| t0 + secs(s);
    let since = |i: Instant| i.saturating_duration_since(t0).as_secs_f64();
    let (d, req) = (EngineId::new("d"), ReqId::new("p-r"));
    let mut sender = SenderCore::new(secs(world.lease), secs(world.renewal));
    sender.handle_update(&req, &SendUpdate::Ready { block_ids: vec![1, 2] }, t0);
    sender.set_renewal_key(&req, KEY);
    let mut watches = WatchList::new();
    watch(&mut watches, "r", "p");
    let mut schedule = RenewalSchedule::new();
    // Renewals on their way to P: when P reads each, in order.
    let mut arriving: VecDeque<f64> = VecDeque::new();
    let mut waiting: Option<AdmissionWait> = None;
    let mut now = 0.0;
    loop {
        // D, while it lives: the renewals due now (sent before P reads).
        let alive = world.d_dies_at.is_none_or(|dies| now < dies);
        if alive {
            for (_, reqs) in schedule.poll_due(&watches, at(now)) {
                assert_eq!(reqs, [renewing("p-r")]);
                let renewed = if within(world.unreachable, now) {
                    Renewed::Failed
                } else if world.renewal == 0.0 {
                    // A P that takes no renewals is sent none.
                    Renewed::Held(Duration::ZERO)
                } else {
                    let sent = now + world.latency;
                    // Behind a message P makes wait, it is read when the wait ends.
                    let read_at = match world.stalled {
                        Some((from, to)) if from <= sent && sent < to => to,
                        _ => sent,
                    };
                    arriving.push_back(read_at.max(arriving.back().copied().unwrap_or(0.0)));
                    Renewed::Held(secs(world.renewal))
                };
                schedule.handle_done(&prefill("p"), renewed, at(now));
            }
        }
        // P: the wait begins or ends; what arrived is read; its own timers.
        match world.stalled {
            Some((from, to)) if from <= now && now < to => {
                waiting.get_or_insert_with(|| AdmissionWait::new(d.clone(), secs(world.renewal), at(from)));
            }
            _ => waiting = None,
        }
        while arriving.front().is_some_and(|&read_at| read_at <= now) {
            arriving.pop_front();
            sender.renew(&[renewing("p-r")], &d, at(now));
        }
        if let Some(waiting) = &mut waiting {
            waiting.handle_timeout(&mut sender, at(now));
        }
        if sender.handle_timeout(at(now)).contains(&req) {
            return Some(now);
        }
        // The next event anyone waits for.
        let mut next = horizon;
        let mut consider = |when: Option<f64>| {
            if let Some(when) = when.filter(|&w| w > now) {
                next = next.min(when);
            }
        };
        consider(alive.then(|| schedule.poll_timeout().map(since)).flatten());
        consider(world.d_dies_at);
        consider(arriving.front().copied());
        consider(world.stalled.map(|(from, _)| from));
        consider(world.stalled.map(|(_, to)| to));
        consider(waiting.as_ref().and_then(AdmissionWait::poll_timeout).map(since));
        consider(sender.next_deadline().map(since));
        if next >= horizon {
            return None;
        }
        now = next;
    }
}

/// P's renewal period is 3 s; D renews every second. Whatever happens
/// between them, P frees the request exactly when the table says (`None`:
/// not within 100 renewal periods), never earlier than its decode instance
/// stopped wanting it and never as late as the abort timeout when it died.
#[rstest]
#[case::held_while_its_decode_instance_lives(WORLD, None)]
#[case::freed_a_renewal_after_the_last_when_it_dies(World { d_dies_at: Some(10.0), ..WORLD }, Some(12.0))]
#[case::freed_at_once_by_a_decode_instance_dead_from_the_start(World { d_dies_at: Some(0.0), ..WORLD }, Some(3600.0))]
#[case::held_over_a_slow_network(World { latency: 2.5, ..WORLD }, None)]
#[case::held_while_p_is_unreachable_shorter_than_a_renewal(World { unreachable: Some((10.0, 11.0)), ..WORLD }, None)]
#[case::freed_when_p_is_unreachable_longer_than_a_renewal(World { unreachable: Some((10.0, 20.0)), ..WORLD }, Some(12.0))]
#[case::held_while_p_makes_it_wait_many_periods(World { stalled: Some((10.0, 40.0)), ..WORLD }, None)]
// A decode instance that dies while P makes it wait: P cannot tell until
// it reads again, so the hold lasts P's wait and one renewal more.
#[case::freed_a_renewal_after_p_s_wait_when_it_died_meanwhile(World { stalled: Some((10.0, 40.0)), d_dies_at: Some(20.0), ..WORLD }, Some(43.0))]
#[case::held_for_the_abort_timeout_without_renewals(World { renewal: 0.0, lease: 30.0, ..WORLD }, Some(30.0))]
fn p_frees_a_watched_request(#[case] world: World, #[case] freed_at: Option<f64>) {
    let horizon = if freed_at == Some(3600.0) { 4000.0 } else { 300.0 };
    let freed = simulate(world, horizon);
    match (freed, freed_at) {
        (Some(got), Some(want)) => assert!((got - want).abs() < 1e-6, "{world:?}: freed at {got} s, not {want} s"),
        (got, want) => assert_eq!(got, want, "{world:?}"),
    }
}
