//! `contract::fuzzing::decide_call` with the decider's ladder: a panic or a
//! broken property is a bug.
#![no_main]

use contract::{
    fuzzing::{decide_call, Ladder},
    ClusterShape, Decision, GroupId, ManagedNode, UnixMillis,
};
use decider::{DesiredView, SlotSet};
use libfuzzer_sys::fuzz_target;

/// The decider, as its `Decide` service runs it.
struct Decider;

impl Ladder for Decider {
    fn decide(
        &mut self,
        desired: &ClusterShape,
        deleting: bool,
        node: &ManagedNode,
        now: UnixMillis,
    ) -> Decision {
        decider::decide_node(&DesiredView::new(desired, deleting), node, now)
    }

    fn inserts(&mut self, desired: &ClusterShape, deleting: bool, held: &[(GroupId, u32)]) -> Vec<Decision> {
        let mut slots = SlotSet::new();
        for (group, index) in held {
            slots.insert_index(group, *index);
        }
        slots.finish();
        decider::inserts(&DesiredView::new(desired, deleting), &slots).collect()
    }
}

fuzz_target!(|data: &[u8]| {
    if let Err(v) = decide_call(data, &mut Decider) {
        panic!("{v}");
    }
});
