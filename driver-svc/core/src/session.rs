//! The driver's side of one run's session with the executor, sans-IO: what
//! goes on the link and when. The run actor and the in-memory simulation both
//! drive a run's link through this type, so the conformance battery exercises
//! the link logic that runs in production.
//!
//! - A link comes up ([`LinkSession::handle_link_up`]): the run claims its
//!   epoch on that stream, resubmits every operation it holds pending
//!   (byte-for-byte as first submitted, so the executor replays or adopts)
//!   and asks for the observations after the last sequence it folded.
//! - A commit is durable ([`LinkSession::handle_released`]): its operations
//!   are submitted, its acknowledgements sent (every one held so far, in as
//!   few messages as [`MAX_REFS_PER_MESSAGE`] allows), and the sessions that
//!   became known asked for from the start.
//! - The link goes down: everything queued for it is dropped. Pending
//!   operations stay recorded and go out again on the next link; unsent
//!   acknowledgements are replaced by the executor resending what it holds.
//! - The executor fences the run (a newer epoch owns it): the run claims
//!   again on a new link, and submits nothing.
//! - A safety tick ([`LinkSession::handle_safety_tick`]): a session still
//!   bootstrapping whose last folded stage has not moved since the previous
//!   tick is asked for what followed it, so that a stage lost on the way
//!   comes again (the executor keeps every stage until it is acknowledged)
//!   within two ticks rather than failing the attempt at its timeout.
//!
//! Messages leave through [`LinkSession::poll_transmit`], each with the link
//! generation it was queued for; the shell sends it on that stream only.

use std::collections::{HashMap, VecDeque};

use contract::{Claim, Operation, SessionId, WatchHealth};

use crate::{
    commit::{AckRef, Released},
    run::RunState,
};

/// The most references (acknowledgements, replay cursors) one message
/// carries. A reference costs about 50 bytes on the wire (each repeats the
/// run uid) and the executor takes messages of up to 4 MiB by default: the
/// acknowledgements of a 100,000-node run's first health reports, sent as
/// one message, were refused, and so was every resend after the link came
/// back (the link broke about once a second, for good).
pub const MAX_REFS_PER_MESSAGE: usize = 10_000;

/// A message for the executor, in domain types (the shell encodes it).
#[derive(Debug, Clone, PartialEq)]
pub enum ToExecutor {
    Claim(Claim),
    /// `resubmission`: the operation was submitted before, on an earlier
    /// link or by an earlier driver process.
    Submit {
        op: Operation,
        resubmission: bool,
    },
    /// Send the observations of each session after the sequence given.
    ObserveFrom(Vec<(SessionId, u64)>),
    Ack(Vec<AckRef>),
    /// How to probe the run's resources, per group.
    Watch(WatchHealth),
}

/// One run's link state. See the module documentation.
#[derive(Debug, Default)]
pub struct LinkSession {
    /// The link generation the run's claim went on; `None` while down.
    link: Option<u64>,
    fenced: bool,
    out: VecDeque<(u64, ToExecutor)>,
    /// Acknowledgements released and not yet queued: they leave together, as
    /// one message, at the next [`LinkSession::flush_acks`].
    acks: Vec<AckRef>,
    /// Submissions dropped because no link was up or the run was fenced.
    dropped: u64,
    /// Each bootstrapping session's last folded stage at the last safety
    /// tick: one entry per session still bootstrapping.
    bootstrap_cursors: HashMap<SessionId, u64>,
}

impl LinkSession {
    pub fn new() -> Self {
        Self::default()
    }

    /// The generation of the link the run is claimed on, if one is up.
    pub fn link(&self) -> Option<u64> {
        self.link
    }

    pub fn is_fenced(&self) -> bool {
        self.fenced
    }

    /// Whether a submission now would go out.
    pub fn sends(&self) -> bool {
        self.link.is_some() && !self.fenced
    }

    /// Submissions dropped so far (link down or fenced).
    pub fn dropped_submissions(&self) -> u64 {
        self.dropped
    }

    /// A link (generation `generation`) is up: claim, resubmit, ask for
    /// observations.
    pub fn handle_link_up(&mut self, generation: u64, run: &RunState) {
        self.link = Some(generation);
        // Whatever was queued for an earlier stream is not sent on this one.
        self.out.clear();
        self.push(ToExecutor::Claim(Claim {
            run_uid: run.uid(),
            run_id: run.run_id().clone(),
            epoch: run.epoch(),
        }));
        if self.fenced {
            return;
        }
        self.push(ToExecutor::Watch(run.watch_health()));
        for op in run.inflight_operations() {
            self.push(ToExecutor::Submit {
                op,
                resubmission: true,
            });
        }
        self.push_chunked(run.observation_cursors(), ToExecutor::ObserveFrom);
    }

    /// The run's shape changed: tell the executor its health policies (they
    /// apply at once, to every resource of the run; they replace nothing).
    pub fn handle_shape_changed(&mut self, run: &RunState) {
        if self.sends() {
            self.push(ToExecutor::Watch(run.watch_health()));
        }
    }

    /// The link broke: nothing queued for it is sent.
    pub fn handle_link_down(&mut self) {
        self.link = None;
        self.out.clear();
        self.acks.clear();
    }

    /// The executor fenced the run's epoch: no further submissions.
    pub fn handle_fenced(&mut self) {
        self.fenced = true;
        self.out
            .retain(|(_, m)| !matches!(m, ToExecutor::Submit { .. } | ToExecutor::Watch(_)));
    }

    /// A commit is durable: submit its operations, acknowledge its folds,
    /// and ask again for the sessions the run learned of.
    pub fn handle_released(&mut self, released: Released, run: &mut RunState) {
        for op in released.operations {
            self.submit(op);
        }
        self.acknowledge(released.acks);
        self.flush_acks();
        self.ask_replays(run);
    }

    /// Submits one operation recorded pending by a durable commit.
    pub fn submit(&mut self, op: Operation) {
        if !self.sends() {
            self.dropped += 1;
            return;
        }
        self.push(ToExecutor::Submit {
            op,
            resubmission: false,
        });
    }

    /// Acknowledges committed folds, to go out with the next
    /// [`LinkSession::flush_acks`]. Without a link they are dropped: the
    /// executor sends them again on the next stream, they fold as
    /// duplicates and are acknowledged then.
    pub fn acknowledge(&mut self, mut acks: Vec<AckRef>) {
        if self.link.is_none() {
            return;
        }
        if self.acks.is_empty() {
            self.acks = acks;
        } else {
            self.acks.append(&mut acks);
        }
    }

    /// Queues every acknowledgement held so far, [`MAX_REFS_PER_MESSAGE`]
    /// to a message.
    pub fn flush_acks(&mut self) {
        let acks = std::mem::take(&mut self.acks);
        self.push_chunked(acks, ToExecutor::Ack);
    }

    /// Asks for the observations of sessions the run learned of after their
    /// observations arrived. Without a link, the next link asks for every
    /// live session anyway.
    pub fn ask_replays(&mut self, run: &mut RunState) {
        let sessions = run.take_replays();
        if self.link.is_none() {
            return;
        }
        self.push_chunked(sessions, ToExecutor::ObserveFrom);
    }

    /// The run's safety tick: each session still bootstrapping whose last
    /// folded stage is the one it had at the previous tick is asked for what
    /// followed it. The executor sends again what it holds unacknowledged:
    /// a stage that never arrived is folded, one already folded is a
    /// duplicate, and a bootstrap that is only slow answers nothing new.
    /// Returns how many sessions were asked.
    pub fn handle_safety_tick(&mut self, run: &RunState) -> usize {
        let previous = std::mem::take(&mut self.bootstrap_cursors);
        let mut quiet = Vec::new();
        for (session, seq) in run.bootstrapping_cursors() {
            if previous.get(session) == Some(&seq) {
                quiet.push((session.clone(), seq));
            }
            self.bootstrap_cursors.insert(session.clone(), seq);
        }
        if !self.sends() {
            return 0;
        }
        let asked = quiet.len();
        self.push_chunked(quiet, ToExecutor::ObserveFrom);
        asked
    }

    /// The next message to send, with the link generation it is for.
    pub fn poll_transmit(&mut self) -> Option<(u64, ToExecutor)> {
        self.out.pop_front()
    }

    /// Queues `refs` as messages of at most [`MAX_REFS_PER_MESSAGE`] each
    /// (none when there are none).
    fn push_chunked<T>(&mut self, refs: Vec<T>, message: fn(Vec<T>) -> ToExecutor) {
        if refs.len() <= MAX_REFS_PER_MESSAGE {
            if !refs.is_empty() {
                self.push(message(refs));
            }
            return;
        }
        let mut refs = refs.into_iter();
        loop {
            let chunk: Vec<T> = refs.by_ref().take(MAX_REFS_PER_MESSAGE).collect();
            if chunk.is_empty() {
                break;
            }
            self.push(message(chunk));
        }
    }

    fn push(&mut self, m: ToExecutor) {
        if let Some(g) = self.link {
            self.out.push_back((g, m));
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use std::sync::Arc;

    use contract::{ClusterShape, Epoch, Generation, RunId, RunUid, UnixMillis};

    use super::*;
    use crate::{policy::Policy, store::MemStore};

    const T0: UnixMillis = UnixMillis::new(1_700_000_000_000);

    /// A run with two creates recorded pending and durable, and what that
    /// commit released.
    fn run_with_two_pending() -> (RunState, Released) {
        let shape = ClusterShape {
            run_id: RunId::parse("run_id", "s").unwrap(),
            generation: Generation::new(1),
            labels: Default::default(),
            groups: vec![contract::NodeGroup {
                id: contract::GroupId::parse("id", "w").unwrap(),
                count: 2,
                template: Arc::new(contract::shape::example_template("fake", "img:1")),
                policy: Default::default(),
            }],
        };
        let mut run = RunState::create(
            shape,
            RunUid::from_u128(5),
            Epoch::new(3),
            Arc::new(Policy::default()),
            T0,
        )
        .unwrap();
        let store = MemStore::new();
        let mut released = Released::default();
        for _ in 0..2 {
            let plan = run.begin_pass(T0).unwrap();
            let out = decider::decide(&run.desired_view(), run.plan_nodes(&plan), run.slot_set(), T0);
            let mut outcome = run.apply_decisions(plan, out, T0).unwrap();
            released = outcome.take_commit().persist_to(&store).unwrap();
        }
        assert_eq!(released.operations.len(), 2);
        (run, released)
    }

    fn drain(s: &mut LinkSession) -> Vec<(u64, ToExecutor)> {
        std::iter::from_fn(|| s.poll_transmit()).collect()
    }

    #[test]
    fn a_link_up_claims_first_then_resubmits_everything_pending() {
        let (run, _) = run_with_two_pending();
        let mut s = LinkSession::new();
        s.handle_link_up(7, &run);
        let out = drain(&mut s);
        assert!(matches!(&out[0], (7, ToExecutor::Claim(c)) if c.epoch == Epoch::new(3)));
        let resubmitted: Vec<_> = out[1..]
            .iter()
            .filter_map(|(g, m)| match m {
                ToExecutor::Submit {
                    op,
                    resubmission: true,
                } if *g == 7 => Some(op.clone()),
                _ => None,
            })
            .collect();
        assert_eq!(resubmitted, run.inflight_operations());
    }

    #[test]
    fn nothing_goes_out_while_the_link_is_down_and_the_next_link_catches_up() {
        let (mut run, released) = run_with_two_pending();
        let mut s = LinkSession::new();
        s.handle_released(released, &mut run);
        assert!(drain(&mut s).is_empty());
        assert_eq!(s.dropped_submissions(), 2);
        s.handle_link_up(1, &run);
        s.handle_link_down();
        assert!(
            drain(&mut s).is_empty(),
            "what was queued for a broken link is dropped"
        );
        s.handle_link_up(2, &run);
        let out = drain(&mut s);
        assert!(out.iter().all(|(g, _)| *g == 2));
        assert_eq!(
            out.iter()
                .filter(|(_, m)| matches!(m, ToExecutor::Submit { .. }))
                .count(),
            2
        );
    }

    #[test]
    fn the_health_policy_follows_the_claim_and_every_shape_change() {
        let (run, _) = run_with_two_pending();
        let mut s = LinkSession::new();
        s.handle_shape_changed(&run);
        assert!(drain(&mut s).is_empty(), "no link: nothing to tell");
        s.handle_link_up(1, &run);
        let out = drain(&mut s);
        assert!(
            matches!(&out[1], (1, ToExecutor::Watch(w)) if w.run_uid == run.uid() && w.epoch == run.epoch())
        );
        s.handle_shape_changed(&run);
        assert!(matches!(drain(&mut s).as_slice(), [(1, ToExecutor::Watch(_))]));
    }

    #[test]
    fn a_fenced_run_claims_but_submits_nothing() {
        let (mut run, released) = run_with_two_pending();
        let mut s = LinkSession::new();
        s.handle_link_up(1, &run);
        s.handle_fenced();
        assert!(
            drain(&mut s)
                .iter()
                .all(|(_, m)| matches!(m, ToExecutor::Claim(_)))
        );
        s.handle_released(released, &mut run);
        assert!(drain(&mut s).is_empty());
        s.handle_link_up(2, &run);
        let out = drain(&mut s);
        assert_eq!(out.len(), 1);
        assert!(matches!(out[0].1, ToExecutor::Claim(_)));
    }

    #[test]
    fn released_operations_and_acknowledgements_go_out_on_the_current_link() {
        let (mut run, released) = run_with_two_pending();
        let mut s = LinkSession::new();
        s.handle_link_up(4, &run);
        let _ = drain(&mut s);
        let mut released = released;
        released.acks.push(AckRef::Result(released.operations[0].id));
        s.handle_released(released, &mut run);
        let out = drain(&mut s);
        assert_eq!(out.len(), 3);
        assert!(out[..2].iter().all(|(g, m)| *g == 4
            && matches!(
                m,
                ToExecutor::Submit {
                    resubmission: false,
                    ..
                }
            )));
        assert!(matches!(&out[2].1, ToExecutor::Ack(a) if a.len() == 1));
    }

    #[test]
    fn many_acknowledgements_go_out_in_bounded_messages() {
        let (run, _) = run_with_two_pending();
        let mut s = LinkSession::new();
        s.handle_link_up(1, &run);
        let _ = drain(&mut s);
        let total = 2 * MAX_REFS_PER_MESSAGE + 7;
        s.acknowledge((0..total as u64).map(|seq| AckRef::Change { seq }).collect());
        s.flush_acks();
        let sizes: Vec<usize> = drain(&mut s)
            .into_iter()
            .map(|(_, m)| match m {
                ToExecutor::Ack(a) => a.len(),
                other => panic!("not an acknowledgement: {other:?}"),
            })
            .collect();
        assert_eq!(sizes, [MAX_REFS_PER_MESSAGE, MAX_REFS_PER_MESSAGE, 7]);
        s.flush_acks();
        assert!(drain(&mut s).is_empty(), "nothing held: nothing sent");
    }
}
