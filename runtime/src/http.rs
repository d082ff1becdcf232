//! The HTTP server thread behind the metrics endpoint and the dashboard: axum on a
//! single-threaded tokio runtime of its own, so a slow client never holds a runtime thread.

use std::net::SocketAddr;

use crate::error::{Error, Result};

/// Binds `bind` now, so that a port in use is an error (naming `what` and the address) before
/// anything is served.
pub(crate) fn listen(what: &str, bind: SocketAddr) -> Result<std::net::TcpListener> {
    let listener = std::net::TcpListener::bind(bind)
        .map_err(|e| Error::Invalid(format!("{what}: cannot listen on {bind}: {e}")))?;
    listener.set_nonblocking(true).map_err(|e| Error::System(format!("{what}: {e}")))?;
    Ok(listener)
}

/// Serves `app` on `listener` from a thread named `rtrun-{what}` until the returned sender
/// fires or is dropped; returns the bound address too.
pub(crate) fn serve(
    what: &'static str,
    listener: std::net::TcpListener,
    app: axum::Router,
) -> Result<(SocketAddr, tokio::sync::oneshot::Sender<()>)> {
    let address = listener.local_addr().map_err(|e| Error::System(format!("{what}: {e}")))?;
    let (shutdown, stopped) = tokio::sync::oneshot::channel::<()>();
    std::thread::Builder::new()
        .name(format!("rtrun-{what}"))
        .spawn(move || {
            let server = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                Ok(server) => server,
                Err(e) => return tracing::error!("{what}: no runtime: {e}"),
            };
            server.block_on(async move {
                let listener = match tokio::net::TcpListener::from_std(listener) {
                    Ok(listener) => listener,
                    Err(e) => return tracing::error!("{what} on {address}: {e}"),
                };
                let served = axum::serve(listener, app)
                    .with_graceful_shutdown(async move {
                        let _ = stopped.await;
                    })
                    .await;
                if let Err(e) = served {
                    tracing::error!("{what} on {address}: {e}");
                }
            });
        })
        .map_err(|e| Error::System(format!("{what} thread: {e}")))?;
    Ok((address, shutdown))
}
