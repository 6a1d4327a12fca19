//! Shape builders for tests.

use std::sync::Arc;

use contract::{ClusterShape, Generation, GroupId, NodeGroup, NodeTemplate, RunId, shape::example_template};

/// A shape of `(group, count, image)` groups on the given provider.
pub fn shape(run: &str, generation: u64, provider: &str, groups: &[(&str, u32, &str)]) -> ClusterShape {
    ClusterShape {
        run_id: RunId::parse("run_id", run).unwrap_or_else(|e| panic!("bad run id in a test: {e}")),
        generation: Generation::new(generation),
        labels: Default::default(),
        groups: groups
            .iter()
            .map(|(id, count, image)| NodeGroup {
                id: GroupId::parse("id", id).unwrap_or_else(|e| panic!("bad group id in a test: {e}")),
                count: *count,
                template: Arc::new(example_template(provider, image)),
                policy: Default::default(),
            })
            .collect(),
    }
}

/// The same shape with one group's template changed.
pub fn with_template(mut s: ClusterShape, group: &str, f: impl Fn(&mut NodeTemplate)) -> ClusterShape {
    for g in &mut s.groups {
        if g.id.as_str() == group {
            f(Arc::make_mut(&mut g.template));
        }
    }
    s
}
