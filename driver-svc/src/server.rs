//! Assembles the driver: the store, the decider client, the executor link and
//! the public API, served until `shutdown` resolves.

use std::{sync::Arc, time::Duration};

use contract::{
    Clock,
    pb::{decider_client::DeciderClient, provisioning_server::ProvisioningServer},
    telemetry::grpc::{ServerLayer, traced},
};
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::transport::Endpoint;

use crate::{
    api::Api,
    core::{Policy, RunStore},
    driver::{Driver, DriverConfig},
    link::Link,
};

/// How long the runs get to stop at shutdown (a pass in flight waits for its
/// Decide answer, which the decider gives in milliseconds when it is up).
const RUNS_STOP_WITHIN: Duration = Duration::from_secs(2);

/// Everything `run` needs besides the listener.
#[derive(Debug)]
pub struct Config {
    /// e.g. `http://127.0.0.1:7001`
    pub decider: String,
    pub executor: String,
    pub policy: Policy,
    pub safety_tick: Duration,
    pub store: Box<dyn RunStore>,
    pub clock: Arc<dyn Clock>,
}

/// Serves the driver on `listener` until `shutdown` resolves.
pub async fn run(
    listener: TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    config: Config,
) -> anyhow::Result<()> {
    let decider_endpoint = Endpoint::from_shared(config.decider.clone())?
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(30));
    let decider = DeciderClient::new(traced(decider_endpoint.connect_lazy()))
        .max_decoding_message_size(16 << 20)
        .max_encoding_message_size(16 << 20);
    let executor_endpoint = Endpoint::from_shared(config.executor.clone())?
        .connect_timeout(Duration::from_secs(2))
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_timeout(Duration::from_secs(10));
    let link = Link::new();
    let driver = Driver::start(DriverConfig {
        store: config.store,
        clock: config.clock,
        decider,
        link: link.clone(),
        policy: config.policy,
        safety_tick: config.safety_tick,
    })?;

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let link_task = tokio::spawn({
        let mut stop = stop_rx.clone();
        async move {
            link.run(executor_endpoint, async move {
                let _ = stop.wait_for(|s| *s).await;
            })
            .await;
        }
    });

    let (_reporter, health, reflection) =
        contract::runtime::health_and_reflection::<ProvisioningServer<Api>>().await?;
    let api = ProvisioningServer::new(Api::new(driver.clone()));
    let mut stop = stop_rx;
    let served = tonic::transport::Server::builder()
        .layer(ServerLayer::new())
        .add_service(health)
        .add_service(reflection)
        .add_service(api)
        .serve_with_incoming_shutdown(TcpListenerStream::new(listener), async move {
            shutdown.await;
            let _ = stop.wait_for(|_| true).await;
        });
    let result = served.await;
    // The runs stop before the executor link closes, so nothing they send on
    // the way out is lost, and before the process flushes its spans.
    driver.shutdown(RUNS_STOP_WITHIN).await;
    let _ = stop_tx.send(true);
    let _ = link_task.await;
    result?;
    Ok(())
}
