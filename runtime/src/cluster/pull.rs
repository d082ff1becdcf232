//! Object pulls between nodes: from another node's store into this node's, or into memory (a
//! driver, which has no store), over connections kept per node.

use super::{Member, member, net_error};
use crate::error::{Error, Result};
use crate::runtime::Runtime;
use crate::transport::Route;

/// A connection to the endpoint of the node daemon at `home` (for pulls), reused.
fn pull_link(member: &Member, home: &str) -> Result<rtrun_net::Connection> {
    let Route::Quic { addr, .. } = Route::parse(home)? else {
        return Err(Error::Invalid(format!("`{home}` is not another node's address")));
    };
    if let Some(link) = member.pulls.get(&addr)
        && link.quinn().close_reason().is_none()
    {
        return Ok(link.clone());
    }
    let link = member.link.clone();
    let connection =
        member
            .link
            .wait(async move {
                crate::transport::connect_with_retries(&link.endpoint, addr, false).await
            })?
            .map_err(net_error(&format!("connecting to the node at {addr}")))?;
    member.pulls.insert(addr, connection.clone());
    Ok(connection)
}

/// Pulls an object from the store of the node daemon at `home` into memory (a process of a
/// cluster without a store of its own: a driver).
pub(crate) fn pull_to_memory(home: &str, id: rtrun_object_store::ObjectId) -> Result<Vec<u8>> {
    let member = member().ok_or(Error::NotInitialised)?;
    let link = pull_link(member, home)?;
    member
        .link
        .wait(async move { link.pull_object(id, rtrun_object_store::PullConfig::default()).await })?
        .map_err(net_error(&format!("pulling {id} from {home}")))
}

/// Copies an object from the store of the node daemon at `home` into this node's store and
/// gives `holder` a count on the copy (this process is the node).
pub(crate) fn pull_into_node(
    runtime: &Runtime,
    id: rtrun_object_store::ObjectId,
    home: &str,
    holder: rtrun_object_store::HolderId,
) -> Result<()> {
    let member = member().ok_or(Error::NotInitialised)?;
    let store = runtime
        .store_client()?
        .node_store()
        .cloned()
        .ok_or_else(|| Error::ObjectStore("only a node process pulls into its store".into()))?;
    let link = pull_link(member, home)?;
    let start = std::time::Instant::now();
    let bytes = member
        .link
        .wait(async move {
            rtrun_net::pull_into_store(
                &link,
                &store,
                id,
                holder,
                rtrun_object_store::PullConfig::default(),
            )
            .await
        })?
        .map_err(net_error(&format!("copying {id} from {home}")))?;
    if bytes > 0 {
        crate::metrics::record_pull(bytes, start.elapsed());
    }
    Ok(())
}
