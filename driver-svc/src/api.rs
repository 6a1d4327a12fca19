//! The public gRPC API served to provisioning clients, and the one function
//! that maps the driver's errors to gRPC statuses.
//!
//! Every handler first authorizes its caller (the [`crate::auth`] layer put
//! the principal in the request): the access the method needs, then the run
//! it touches. A refused call is answered before anything is read or changed.

use std::{pin::Pin, sync::Arc};

use contract::{
    ClusterShape, FieldError, GroupId, LogicalNodeId, RunId, UnixMillis, pb,
    pb::provisioning_server::Provisioning,
    wire::{event_to_wire, shape_from_wire},
};
use futures::Stream;
use tonic::{Request, Response, Status};

use crate::{
    auth::{Access, principal},
    core::{Applied, ApplyError, StoreError},
    driver::{Driver, DriverError},
    orphans::Orphan,
    status::{DEFAULT_NODE_PAGE, MAX_NODE_PAGE},
};

/// Maps a driver error to its gRPC status. A rejected request changes nothing.
pub fn to_status(e: DriverError) -> Status {
    match e {
        // Field paths name the request's field, as the wire checks do.
        DriverError::Apply(ApplyError::Invalid(f)) => invalid(&f.within("shape")),
        DriverError::Apply(e @ ApplyError::RunIdChanged { .. })
        | DriverError::Apply(e @ ApplyError::GenerationRegressed { .. })
        | DriverError::Apply(e @ ApplyError::SameGenerationOtherContent(_))
        | DriverError::Apply(e @ ApplyError::Deleting(_)) => Status::failed_precondition(e.to_string()),
        e @ (DriverError::NotFound(_) | DriverError::NodeNotFound { .. }) => Status::not_found(e.to_string()),
        DriverError::Store(s) => store_status(s),
        e @ (DriverError::ActorGone | DriverError::Halted(_) | DriverError::Moving(_)) => {
            Status::unavailable(e.to_string())
        }
        DriverError::Elsewhere { run, owner } => elsewhere(&run, &owner),
        e @ DriverError::Exhausted(_) => Status::failed_precondition(e.to_string()),
        e @ DriverError::Internal(_) => Status::internal(e.to_string()),
        DriverError::Promote(e @ crate::core::PromoteError::NoSuchGroup(_)) => {
            Status::not_found(e.to_string())
        }
        DriverError::Promote(e @ crate::core::PromoteError::NoRollout(_)) => {
            Status::failed_precondition(e.to_string())
        }
    }
}

/// A store's failure: `UNAVAILABLE` only for what a retry can outlast.
fn store_status(e: StoreError) -> Status {
    let message = format!("store: {e}");
    match e {
        StoreError::Unavailable(_) => Status::unavailable(message),
        StoreError::Corrupt(_) => Status::data_loss(message),
        StoreError::NameTaken { .. } => Status::already_exists(message),
        StoreError::UnknownRun(_) => Status::internal(message),
    }
}

pub use contract::metadata::{OWNER_ADDRESS, OWNER_ID};

/// Another replica serves the run: `FAILED_PRECONDITION` (this replica will
/// not serve it), with the owner's address in the message and in the
/// `provisioning-owner-address` metadata, which clients follow.
fn elsewhere(run: &str, owner: &crate::replicas::Owner) -> Status {
    let e = DriverError::Elsewhere {
        run: run.to_owned(),
        owner: owner.clone(),
    };
    let mut status = Status::failed_precondition(e.to_string());
    let md = status.metadata_mut();
    if let Ok(v) = owner.id.parse() {
        md.insert(OWNER_ID, v);
    }
    if let Some(a) = &owner.address
        && let Ok(v) = a.parse()
    {
        md.insert(OWNER_ADDRESS, v);
    }
    status
}

/// `INVALID_ARGUMENT` naming the field, with the field path also in the
/// message so plain clients show it.
fn invalid(f: &FieldError) -> Status {
    Status::invalid_argument(f.to_string())
}

fn shape_arg(shape: Option<pb::ClusterShape>) -> Result<ClusterShape, Status> {
    let shape = shape.ok_or_else(|| invalid(&FieldError::new("shape", contract::Problem::Missing)))?;
    shape_from_wire(shape).map_err(|e| invalid(&e.within("shape")))
}

fn run_id_arg(run_id: &str) -> Result<RunId, Status> {
    RunId::parse("run_id", run_id).map_err(|e| invalid(&e))
}

/// A request's node id, checked as the run id is.
fn node_id_arg(node_id: &str) -> Result<LogicalNodeId, Status> {
    LogicalNodeId::parse("node_id", node_id).map_err(|e| invalid(&e))
}

/// The `Provisioning` service over a [`Driver`].
#[derive(Debug, Clone)]
pub struct Api {
    driver: Driver,
    send_limit: usize,
}

impl Api {
    /// `send_limit`: the largest message the service sends (its encoder's
    /// limit); a status with its nodes over it is refused by name.
    pub fn new(driver: Driver, send_limit: usize) -> Self {
        Self { driver, send_limit }
    }

    /// A status with every node (`include_nodes`) over the message limit is
    /// refused here, saying what to read instead, rather than failed by the
    /// encoder.
    fn fits(&self, status: &pb::RunStatus) -> Result<(), Status> {
        let len = prost::Message::encoded_len(status);
        if len <= self.send_limit {
            return Ok(());
        }
        Err(Status::resource_exhausted(format!(
            "include_nodes: the status of run {} with its {} nodes is {len} bytes, over the \
             {}-byte message limit; read its nodes a page at a time with ListNodes",
            status.run_id, status.node_count, self.send_limit
        )))
    }
}

type WatchStream = Pin<Box<dyn Stream<Item = Result<pb::RunStatus, Status>> + Send>>;
type EventStream = Pin<Box<dyn Stream<Item = Result<pb::Event, Status>> + Send>>;

#[tonic::async_trait]
impl Provisioning for Api {
    async fn apply(&self, req: Request<pb::ApplyRequest>) -> Result<Response<pb::ApplyResponse>, Status> {
        let who = principal(&req, Access::Write, "Apply")?;
        let shape = shape_arg(req.into_inner().shape)?;
        who.require_run(shape.run_id.as_str())?;
        let generation = shape.generation.get();
        let out = self.driver.apply(shape).await.map_err(to_status)?;
        Ok(Response::new(pb::ApplyResponse {
            run_uid: out.uid.to_string(),
            generation,
            changed: out.applied == Applied::Changed,
            created: out.created,
        }))
    }

    async fn plan(&self, req: Request<pb::PlanRequest>) -> Result<Response<pb::PlanResponse>, Status> {
        let who = principal(&req, Access::Read, "Plan")?;
        let shape = shape_arg(req.into_inner().shape)?;
        who.require_run(shape.run_id.as_str())?;
        Ok(Response::new(self.driver.plan(shape).await.map_err(to_status)?))
    }

    async fn get_run(&self, req: Request<pb::GetRunRequest>) -> Result<Response<pb::RunStatus>, Status> {
        let who = principal(&req, Access::Read, "GetRun")?;
        let r = req.into_inner();
        let id = run_id_arg(&r.run_id)?;
        who.require_run(id.as_str())?;
        let status = self.driver.get(&id, r.include_nodes).await.map_err(to_status)?;
        if r.include_nodes {
            self.fits(&status)?;
        }
        Ok(Response::new(status))
    }

    async fn list_runs(
        &self,
        req: Request<pb::ListRunsRequest>,
    ) -> Result<Response<pb::ListRunsResponse>, Status> {
        let who = principal(&req, Access::Read, "ListRuns")?;
        let selector = contract::labels::Selector::parse("label_selector", &req.get_ref().label_selector)
            .map_err(|e| invalid(&e))?;
        let mut runs = self.driver.list().await.map_err(to_status)?;
        runs.retain(|r| who.may_see(&r.run_id) && selector.matches(|k| r.labels.get(k).map(String::as_str)));
        Ok(Response::new(pb::ListRunsResponse { runs }))
    }

    type WatchRunStream = WatchStream;

    async fn watch_run(
        &self,
        req: Request<pb::WatchRunRequest>,
    ) -> Result<Response<Self::WatchRunStream>, Status> {
        let who = principal(&req, Access::Read, "WatchRun")?;
        let r = req.into_inner();
        let id = run_id_arg(&r.run_id)?;
        who.require_run(id.as_str())?;
        let driver = self.driver.clone();
        let mut rx = driver.watch(&id).await.map_err(to_status)?;
        let include_nodes = r.include_nodes;
        let api = self.clone();
        let stream = async_stream(move |tx| async move {
            loop {
                let status = if include_nodes {
                    match driver.get(&id, true).await {
                        Ok(s) => s,
                        Err(_) => (**rx.borrow_and_update()).clone(),
                    }
                } else {
                    (**rx.borrow_and_update()).clone()
                };
                if include_nodes && let Err(refused) = api.fits(&status) {
                    let _ = tx.send(Err(refused)).await;
                    break;
                }
                let last = status.phase == pb::RunPhase::Deleted as i32;
                if tx.send(Ok(status)).await.is_err() || last {
                    break;
                }
                let changed = tokio::select! {
                    changed = rx.changed() => changed,
                    // The client went away: end now, not at the run's next
                    // change, so an idle run holds no task per past watcher.
                    () = tx.closed() => break,
                };
                if changed.is_err() {
                    // The actor finished. The run is gone: send its final
                    // status. Otherwise it was reloaded from the store (the
                    // watch follows it) or is served elsewhere now (the
                    // watch ends with where).
                    let final_status = (**rx.borrow()).clone();
                    if final_status.phase == pb::RunPhase::Deleted as i32 {
                        let _ = tx.send(Ok(final_status)).await;
                        break;
                    }
                    match rewatch(&driver, &id).await {
                        Ok(next) => rx = next,
                        Err(status) => {
                            let _ = tx.send(Err(status)).await;
                            break;
                        }
                    }
                }
            }
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn explain_node(
        &self,
        req: Request<pb::ExplainNodeRequest>,
    ) -> Result<Response<pb::NodeExplanation>, Status> {
        let who = principal(&req, Access::Read, "ExplainNode")?;
        let r = req.into_inner();
        let id = run_id_arg(&r.run_id)?;
        who.require_run(id.as_str())?;
        Ok(Response::new(
            self.driver
                .explain(&id, &node_id_arg(&r.node_id)?)
                .await
                .map_err(to_status)?,
        ))
    }

    async fn list_nodes(
        &self,
        req: Request<pb::ListNodesRequest>,
    ) -> Result<Response<pb::ListNodesResponse>, Status> {
        let who = principal(&req, Access::Read, "ListNodes")?;
        let r = req.into_inner();
        let id = run_id_arg(&r.run_id)?;
        who.require_run(id.as_str())?;
        let after = if r.page_token.is_empty() {
            None
        } else {
            Some(LogicalNodeId::parse("page_token", &r.page_token).map_err(|e| invalid(&e))?)
        };
        let mut slots = match usize::try_from(r.page_size).unwrap_or(usize::MAX) {
            0 => DEFAULT_NODE_PAGE,
            n => n.min(MAX_NODE_PAGE),
        };
        // A page over the message limit (long failure reasons, a small
        // limit) is read again at half the size, down to one slot.
        loop {
            let page = self
                .driver
                .nodes(&id, after.clone(), slots)
                .await
                .map_err(to_status)?;
            if slots == 1 || prost::Message::encoded_len(&page) <= self.send_limit {
                return Ok(Response::new(page));
            }
            slots /= 2;
        }
    }

    async fn delete_run(
        &self,
        req: Request<pb::DeleteRunRequest>,
    ) -> Result<Response<pb::RunStatus>, Status> {
        let who = principal(&req, Access::Write, "DeleteRun")?;
        let r = req.into_inner();
        let id = run_id_arg(&r.run_id)?;
        who.require_run(id.as_str())?;
        Ok(Response::new(self.driver.delete(&id).await.map_err(to_status)?))
    }

    async fn pause_run(&self, req: Request<pb::PauseRunRequest>) -> Result<Response<pb::RunStatus>, Status> {
        let who = principal(&req, Access::Write, "PauseRun")?;
        let r = req.into_inner();
        let id = run_id_arg(&r.run_id)?;
        who.require_run(id.as_str())?;
        Ok(Response::new(
            self.driver.set_paused(&id, true).await.map_err(to_status)?,
        ))
    }

    async fn promote_rollout(
        &self,
        req: Request<pb::PromoteRolloutRequest>,
    ) -> Result<Response<pb::RunStatus>, Status> {
        let who = principal(&req, Access::Write, "PromoteRollout")?;
        let r = req.into_inner();
        let id = run_id_arg(&r.run_id)?;
        let group = GroupId::parse("group_id", &r.group_id).map_err(|e| invalid(&e))?;
        who.require_run(id.as_str())?;
        Ok(Response::new(
            self.driver.promote(&id, group).await.map_err(to_status)?,
        ))
    }

    async fn resume_run(
        &self,
        req: Request<pb::ResumeRunRequest>,
    ) -> Result<Response<pb::RunStatus>, Status> {
        let who = principal(&req, Access::Write, "ResumeRun")?;
        let r = req.into_inner();
        let id = run_id_arg(&r.run_id)?;
        who.require_run(id.as_str())?;
        Ok(Response::new(
            self.driver.set_paused(&id, false).await.map_err(to_status)?,
        ))
    }

    async fn abandon_node(
        &self,
        req: Request<pb::AbandonNodeRequest>,
    ) -> Result<Response<pb::AbandonNodeResponse>, Status> {
        let who = principal(&req, Access::Write, "AbandonNode")?;
        let r = req.into_inner();
        let id = run_id_arg(&r.run_id)?;
        who.require_run(id.as_str())?;
        let orphan = self
            .driver
            .abandon(&id, &node_id_arg(&r.node_id)?)
            .await
            .map_err(to_status)?;
        Ok(Response::new(pb::AbandonNodeResponse {
            orphan: Some(orphan_to_wire(&orphan)),
        }))
    }

    async fn list_events(
        &self,
        req: Request<pb::ListEventsRequest>,
    ) -> Result<Response<pb::ListEventsResponse>, Status> {
        let who = principal(&req, Access::Read, "ListEvents")?;
        let r = req.into_inner();
        let id = run_id_arg(&r.run_id)?;
        who.require_run(id.as_str())?;
        let limit = usize::try_from(r.limit).unwrap_or(usize::MAX);
        let (events, last_seq) = self
            .driver
            .events(&id, r.after_seq, limit)
            .await
            .map_err(to_status)?;
        Ok(Response::new(pb::ListEventsResponse {
            events: events.iter().map(|e| event_to_wire(&id, e)).collect(),
            last_seq,
            now_ms: self.driver.now().as_millis(),
        }))
    }

    type WatchEventsStream = EventStream;

    /// The events after the request's `after_seq`, then each one committed
    /// (a repeat of the latest is sent again with its new count), until the
    /// client goes or the run is deleted.
    async fn watch_events(
        &self,
        req: Request<pb::WatchEventsRequest>,
    ) -> Result<Response<Self::WatchEventsStream>, Status> {
        let who = principal(&req, Access::Read, "WatchEvents")?;
        let r = req.into_inner();
        let id = run_id_arg(&r.run_id)?;
        who.require_run(id.as_str())?;
        let driver = self.driver.clone();
        let mut rx = driver.watch_events(&id).await.map_err(to_status)?;
        // The latest event sent (at first, the client's cursor) and its
        // count when sent (unknown for the client's own until first read).
        let mut cursor = r.after_seq;
        let mut cursor_count: Option<u32> = None;
        let stream = async_stream(move |tx| async move {
            loop {
                rx.borrow_and_update();
                let events = match driver.events(&id, cursor.saturating_sub(1), 0).await {
                    Ok((events, _)) => events,
                    Err(crate::driver::DriverError::NotFound(_)) => break,
                    Err(e) => {
                        let _ = tx.send(Err(to_status(e))).await;
                        break;
                    }
                };
                for e in events {
                    if e.seq < cursor {
                        continue;
                    }
                    if e.seq == cursor {
                        match cursor_count {
                            None => {
                                cursor_count = Some(e.count);
                                continue;
                            }
                            Some(c) if e.count <= c => continue,
                            Some(_) => {}
                        }
                    }
                    cursor = e.seq;
                    cursor_count = Some(e.count);
                    if tx.send(Ok(event_to_wire(&id, &e))).await.is_err() {
                        return;
                    }
                }
                let changed = tokio::select! {
                    changed = rx.changed() => changed,
                    () = tx.closed() => break,
                };
                if changed.is_err() {
                    // The actor finished: the run is gone, or it restarted
                    // here after a reload (follow it), or moved elsewhere.
                    match rewatch(&driver, &id).await {
                        Ok(_) => match driver.watch_events(&id).await {
                            Ok(next) => rx = next,
                            Err(_) => break,
                        },
                        Err(status) => {
                            if status.code() != tonic::Code::NotFound {
                                let _ = tx.send(Err(status)).await;
                            }
                            break;
                        }
                    }
                }
            }
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn list_providers(
        &self,
        req: Request<pb::ListProvidersRequest>,
    ) -> Result<Response<pb::ListProvidersResponse>, Status> {
        principal(&req, Access::Read, "ListProviders")?;
        let served = self.driver.link().providers();
        Ok(Response::new(pb::ListProvidersResponse {
            known: served.is_some(),
            providers: served
                .iter()
                .flat_map(|s| s.iter())
                .map(pb::ServedProvider::from)
                .collect(),
        }))
    }

    async fn list_orphans(
        &self,
        req: Request<pb::ListOrphansRequest>,
    ) -> Result<Response<pb::ListOrphansResponse>, Status> {
        let who = principal(&req, Access::Read, "ListOrphans")?;
        let orphans = self
            .driver
            .orphans()
            .iter()
            .filter(|o| who.may_see(o.resource.identity.run_id.as_str()))
            .map(orphan_to_wire)
            .collect();
        Ok(Response::new(pb::ListOrphansResponse { orphans }))
    }
}

fn orphan_to_wire(o: &Orphan) -> pb::Orphan {
    pb::Orphan {
        resource: Some(pb::Resource::from(&o.resource)),
        reason: o.reason.clone(),
        recorded_at_ms: UnixMillis::to_wire(o.recorded_at),
    }
}

/// A stream fed by a task through a bounded channel, so a slow client applies
/// backpressure instead of growing a buffer.
fn async_stream<T, F, Fut>(f: F) -> impl Stream<Item = T> + Send
where
    T: Send + 'static,
    F: FnOnce(tokio::sync::mpsc::Sender<T>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    tokio::spawn(f(tx));
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

/// A watch of a run whose actor ended without the run being deleted: the
/// run's next actor here (after a reload), or the status that says where it
/// went. Waits a little for a reload to start the next actor.
async fn rewatch(
    driver: &Driver,
    run_id: &RunId,
) -> Result<tokio::sync::watch::Receiver<Arc<pb::RunStatus>>, Status> {
    for _ in 0..REWATCH_TRIES {
        tokio::time::sleep(REWATCH_WAIT).await;
        match driver.watch(run_id).await {
            Ok(rx) if rx.has_changed().is_ok() => return Ok(rx),
            Ok(_) => {}
            Err(e) => return Err(to_status(e)),
        }
    }
    Err(Status::unavailable(format!(
        "run {run_id} stopped here and has not restarted; watch it again"
    )))
}

const REWATCH_WAIT: std::time::Duration = std::time::Duration::from_millis(50);
const REWATCH_TRIES: u32 = 200;

#[cfg(test)]
mod tests {
    use tonic::Code;

    use super::*;

    /// `UNAVAILABLE` tells a client to retry; only what a retry can outlast
    /// says so.
    #[test]
    fn each_error_maps_to_the_status_a_client_can_act_on() {
        let cases = [
            (DriverError::NotFound("r".into()), Code::NotFound),
            (
                DriverError::Store(StoreError::Unavailable("down".into())),
                Code::Unavailable,
            ),
            (
                DriverError::Store(StoreError::Corrupt("bad page".into())),
                Code::DataLoss,
            ),
            (
                DriverError::Store(StoreError::NameTaken {
                    run_id: "r".into(),
                    holder: "u".into(),
                }),
                Code::AlreadyExists,
            ),
            (DriverError::Halted("store refused".into()), Code::Unavailable),
            (DriverError::Moving("r".into()), Code::Unavailable),
            (
                DriverError::Exhausted("attempt id allocator exhausted".into()),
                Code::FailedPrecondition,
            ),
            (DriverError::Internal("clock saturated".into()), Code::Internal),
        ];
        for (error, code) in cases {
            let said = error.to_string();
            let status = to_status(error);
            assert_eq!(status.code(), code, "{said}");
            assert!(
                status.message().contains(&said) || said.contains(status.message()),
                "{said}"
            );
        }
        let exhausted = to_status(DriverError::Exhausted("attempt id allocator exhausted".into()));
        assert!(
            exhausted.message().contains("delete it and create it again"),
            "{exhausted}"
        );
    }
}
