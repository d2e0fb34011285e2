//! A member's `Status` with the metadata only keel sends (what its history holds), for
//! `keel cluster status`. etcd's client libraries drop response metadata, so this makes the
//! call itself.

use std::time::Duration;

use etcd_client::proto::{PbStatusRequest, PbStatusResponse};
use tonic::codegen::http::uri::PathAndQuery;
use tonic::transport::{ClientTlsConfig, Endpoint};

use crate::etcd_api::{COMPACT_REVISION, HISTORY_BYTES, HISTORY_CHANGES};

/// What a member's history holds, from its `Status` metadata.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HistoryStatus {
    /// Bytes the change feed holds in memory.
    pub bytes: u64,
    /// Changes the change feed holds.
    pub changes: u64,
    /// The compacted revision.
    pub compact_revision: i64,
}

/// Asks the member at `url` (a client URL) for its history figures; `None` fields read as 0
/// when the member is not keel.
pub async fn history_status(
    url: &str,
    tls: Option<ClientTlsConfig>,
    timeout: Duration,
) -> Result<HistoryStatus, String> {
    let mut endpoint =
        Endpoint::from_shared(url.to_string()).map_err(|e| e.to_string())?.connect_timeout(timeout).timeout(timeout);
    if let Some(tls) = tls {
        endpoint = endpoint.tls_config(tls).map_err(|e| e.to_string())?;
    }
    let channel = endpoint.connect().await.map_err(|e| e.to_string())?;
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.map_err(|e| e.to_string())?;
    let resp: tonic::Response<PbStatusResponse> = grpc
        .unary(
            tonic::Request::new(PbStatusRequest {}),
            PathAndQuery::from_static("/etcdserverpb.Maintenance/Status"),
            tonic_prost::ProstCodec::default(),
        )
        .await
        .map_err(|e| e.message().to_string())?;
    let md = resp.metadata();
    let num = |key: &str| md.get(key).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<i64>().ok()).unwrap_or(0);
    Ok(HistoryStatus {
        bytes: num(HISTORY_BYTES).max(0) as u64,
        changes: num(HISTORY_CHANGES).max(0) as u64,
        compact_revision: num(COMPACT_REVISION),
    })
}
