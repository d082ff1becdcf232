//! The web dashboard (`rtrun head --dashboard-port`, `train --dashboard-port`): server-side HTML
//! pages over the same state queries `rtrun status` and `rtrun list` use.
//!
//! Pages: overview, nodes, actors (with each one's log), placement groups (the bundle → node and
//! GPU table), jobs (each with its live log), objects per node, and the pages an embedding
//! program adds ([`Panel`], e.g. `train`'s live reward and KL curve). Pages refresh themselves
//! every few seconds. Rendered with minijinja (escaped HTML), served by axum on a thread of its
//! own; nothing is fetched from elsewhere, so it works offline.
//!
//! Bound to loopback it is open, like Ray's dashboard; bound to any other address it needs a
//! token (given, or generated and printed), passed once as `?token=…` (then kept in a cookie) or
//! as `Authorization: Bearer …`. A request without it gets 401 and a sentence saying so.

mod pages;

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{Html, IntoResponse, Response};

use crate::error::{Error, Result};

/// A page an embedding program adds to the dashboard (listed in its navigation).
pub trait Panel: Send + Sync {
    /// The navigation title, also the page's heading.
    fn title(&self) -> String;
    /// The page's body, as HTML (the panel escapes what it embeds).
    fn body_html(&self) -> String;
}

/// Where and how to serve the dashboard.
#[derive(Clone, Default)]
pub struct DashboardOptions {
    /// The address to listen on.
    pub bind: Option<SocketAddr>,
    /// The token requests must carry; `None`: none on loopback, a generated one elsewhere.
    pub token: Option<String>,
    /// Extra pages.
    pub panels: Vec<Arc<dyn Panel>>,
}

impl std::fmt::Debug for DashboardOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DashboardOptions")
            .field("bind", &self.bind)
            .field("token", &self.token.as_ref().map(|_| "…"))
            .field("panels", &self.panels.len())
            .finish()
    }
}

/// A running dashboard; stops when dropped.
#[derive(Debug)]
pub struct Dashboard {
    address: SocketAddr,
    token: Option<String>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Dashboard {
    /// The address it listens on.
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// The token requests need, if any.
    pub fn token(&self) -> Option<&str> {
        self.token.as_deref()
    }

    /// The URL to open (with the token, when one is needed).
    pub fn url(&self) -> String {
        match &self.token {
            Some(token) => format!("http://{}/?token={token}", self.address),
            None => format!("http://{}/", self.address),
        }
    }
}

impl Drop for Dashboard {
    fn drop(&mut self) {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
    }
}

struct AppState {
    token: Option<String>,
    panels: Vec<Arc<dyn Panel>>,
    templates: minijinja::Environment<'static>,
}

/// Starts the dashboard for this process's runtime. A port in use is an error naming the
/// address, returned before anything is served.
pub fn serve(options: DashboardOptions) -> Result<Dashboard> {
    let bind = options.bind.unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 8265)));
    let token = match options.token {
        Some(token) if token.trim().is_empty() => {
            return Err(Error::Invalid("dashboard: the token is empty".into()));
        }
        Some(token) => Some(token),
        None if bind.ip().is_loopback() => None,
        None => Some(format!("{:016x}{:016x}", crate::runtime::random_u64(), random_u64())),
    };
    let listener = crate::http::listen("dashboard", bind)?;
    let state = Arc::new(AppState {
        token: token.clone(),
        panels: options.panels,
        templates: pages::templates()?,
    });
    let (address, shutdown) = crate::http::serve("dashboard", listener, router(state))?;
    Ok(Dashboard { address, token, shutdown: Some(shutdown) })
}

fn random_u64() -> u64 {
    crate::runtime::random_u64().rotate_left(17) ^ u64::from(std::process::id())
}

fn router(state: Arc<AppState>) -> axum::Router {
    use axum::routing::get;
    axum::Router::new()
        .route("/", get(|s: State<Arc<AppState>>| page(s, "overview")))
        .route("/nodes", get(|s: State<Arc<AppState>>| page(s, "nodes")))
        .route("/actors", get(|s: State<Arc<AppState>>| page(s, "actors")))
        .route("/placement-groups", get(|s: State<Arc<AppState>>| page(s, "groups")))
        .route("/jobs", get(|s: State<Arc<AppState>>| page(s, "jobs")))
        .route("/objects", get(|s: State<Arc<AppState>>| page(s, "objects")))
        .route("/actors/{id}/log", get(actor_log))
        .route("/jobs/{name}", get(job_page))
        .route("/panels/{index}", get(panel_page))
        .layer(axum::middleware::from_fn_with_state(state.clone(), authorize))
        .with_state(state)
}

/// Lets a request through when no token is needed or it carries the token (query, bearer or
/// cookie); a valid `?token=` also sets the cookie.
async fn authorize(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    let Some(token) = state.token.as_deref() else { return next.run(request).await };
    // Constant time in the token's content: every byte is compared whatever the first
    // difference (the length is not secret: tokens are 32 hex digits).
    let matches = |given: &str| {
        given.len() == token.len()
            && given.bytes().zip(token.bytes()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
    };
    let in_query = request
        .uri()
        .query()
        .and_then(|q| q.split('&').find_map(|pair| pair.strip_prefix("token=")))
        .is_some_and(matches);
    let in_headers = header_token(request.headers()).is_some_and(|t| matches(&t));
    if !(in_query || in_headers) {
        let message = "rtrun dashboard: this address needs the dashboard token. Open the URL \
                       the head printed (…/?token=…) or send `Authorization: Bearer <token>`.\n";
        return (StatusCode::UNAUTHORIZED, message).into_response();
    }
    let mut response = next.run(request).await;
    if in_query
        && let Ok(cookie) = HeaderValue::from_str(&format!(
            "rtrun_token={token}; HttpOnly; SameSite=Strict; Path=/"
        ))
    {
        response.headers_mut().insert(header::SET_COOKIE, cookie);
    }
    response
}

fn header_token(headers: &HeaderMap) -> Option<String> {
    if let Some(bearer) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
    {
        return Some(bearer.trim().to_owned());
    }
    headers.get_all(header::COOKIE).iter().filter_map(|v| v.to_str().ok()).find_map(|cookies| {
        cookies.split(';').find_map(|c| c.trim().strip_prefix("rtrun_token=").map(str::to_owned))
    })
}

/// Renders on a blocking thread (the state queries block); errors become a 503 page.
async fn rendered(
    state: Arc<AppState>,
    render: impl FnOnce(&AppState) -> Result<String> + Send + 'static,
) -> Response {
    match tokio::task::spawn_blocking(move || render(&state)).await {
        Ok(Ok(html)) => Html(html).into_response(),
        Ok(Err(Error::Invalid(message))) => (StatusCode::NOT_FOUND, message).into_response(),
        Ok(Err(e)) => {
            (StatusCode::SERVICE_UNAVAILABLE, format!("rtrun dashboard: {e}\n")).into_response()
        }
        Err(e) => {
            (StatusCode::INTERNAL_SERVER_ERROR, format!("rtrun dashboard: {e}\n")).into_response()
        }
    }
}

async fn page(State(state): State<Arc<AppState>>, name: &'static str) -> Response {
    rendered(state, move |s| pages::render_page(s, name)).await
}

async fn actor_log(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> Response {
    rendered(state, move |s| pages::render_actor_log(s, &id)).await
}

async fn job_page(State(state): State<Arc<AppState>>, Path(name): Path<String>) -> Response {
    rendered(state, move |s| pages::render_job(s, &name)).await
}

async fn panel_page(State(state): State<Arc<AppState>>, Path(index): Path<usize>) -> Response {
    rendered(state, move |s| pages::render_panel(s, index)).await
}
