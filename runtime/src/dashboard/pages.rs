//! The dashboard's pages: state queries of this process's runtime, rendered by minijinja.

use std::collections::BTreeMap;
use std::sync::Arc;

use minijinja::{Environment, Value, context};
use serde::Serialize;

use super::AppState;
use crate::error::{Error, Result};
use crate::protocol::{Ask, JobOutput, LogChunk, NodeInfo, ask};
use crate::runtime::{Runtime, To};
use rtrun_proto::actor::short_type;

/// The bytes of a log shown at once (its end).
const LOG_TAIL: u64 = 64 << 10;

const BASE: &str = r#"<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="refresh" content="{{ refresh | default(5) }}">
<title>{{ title }} · rtrun</title>
<style>
body { font: 14px/1.4 system-ui, sans-serif; margin: 0; color: #1d232a; background: #f6f7f9; }
nav { background: #1d2a3a; padding: 8px 16px; }
nav a { color: #dfe7f1; margin-right: 16px; text-decoration: none; }
nav a.here { color: #fff; font-weight: 600; border-bottom: 2px solid #6cb4ff; }
main { padding: 16px 24px; }
h1 { font-size: 20px; margin: 4px 0 12px; }
table { border-collapse: collapse; background: #fff; margin-bottom: 16px; }
th, td { border: 1px solid #d9dee5; padding: 4px 10px; text-align: left; vertical-align: top; }
th { background: #eef1f5; }
.cards { display: flex; gap: 12px; flex-wrap: wrap; margin-bottom: 16px; }
.card { background: #fff; border: 1px solid #d9dee5; padding: 10px 16px; min-width: 150px; }
.card b { display: block; font-size: 22px; }
.dead { color: #b3261e; } .alive { color: #1e7b34; }
pre { background: #10161d; color: #d8e1ea; padding: 10px; overflow: auto; max-height: 70vh; }
</style></head>
<body><nav>
{% for link in nav %}<a href="{{ link.href }}" class="{{ 'here' if link.here }}">{{ link.title }}</a>{% endfor %}
</nav><main><h1>{{ title }}</h1>
{% block body %}{% endblock %}
</main></body></html>
"#;

const OVERVIEW: &str = r#"{% extends "base.html" %}{% block body %}
<div class="cards">
<div class="card">nodes<b>{{ alive_nodes }} alive</b>{{ dead_nodes }} dead</div>
<div class="card">actors<b>{{ actors.alive }} alive</b>{{ actors.pending }} pending, {{ actors.dead }} dead</div>
<div class="card">tasks<b>{{ info.tasks.running }} running</b>{{ info.tasks.queued }} queued, {{ info.tasks.finished }} finished, {{ info.tasks.failed }} failed</div>
<div class="card">worker processes<b>{{ info.workers }}</b></div>
<div class="card">placement groups<b>{{ groups }}</b></div>
<div class="card">jobs<b>{{ jobs }}</b></div>
</div>
<table><tr><th>resource</th><th>total</th><th>available</th></tr>
{% for name, total in info.total | items %}<tr><td>{{ name }}</td><td>{{ total }}</td><td>{{ info.available[name] }}</td></tr>{% endfor %}
</table>
{% endblock %}"#;

const NODES: &str = r#"{% extends "base.html" %}{% block body %}
<table><tr><th>node</th><th>name</th><th>state</th><th>address</th><th>resources</th><th>available</th></tr>
{% for n in nodes %}<tr><td>{{ n.node }}</td><td>{{ n.name }}</td>
<td class="{{ 'alive' if n.alive else 'dead' }}">{{ 'ALIVE' if n.alive else 'DEAD (' ~ n.death_reason ~ ')' }}</td>
<td>{{ n.address }}</td><td>{{ n.total }}</td><td>{{ n.available }}</td></tr>{% endfor %}
</table>{% endblock %}"#;

const ACTORS: &str = r#"{% extends "base.html" %}{% block body %}
<table><tr><th>actor</th><th>type</th><th>name</th><th>lifetime</th><th>state</th><th>node</th><th>pid</th><th>restarts</th><th>log</th></tr>
{% for a in actors %}<tr><td>{{ a.actor }}</td><td>{{ a.type_name }}</td><td>{{ a.name or '' }}</td>
<td>{{ 'detached' if a.detached }}</td><td class="{{ 'alive' if a.state == 'ALIVE' else ('dead' if a.state is startingwith('DEAD')) }}">{{ a.state }}</td>
<td>{{ a.node or '' }}</td><td>{{ a.pid or '' }}</td><td>{{ a.restarts }}</td>
<td>{% if a.worker %}<a href="/actors/{{ a.actor }}/log">{{ a.worker }}.log</a>{% endif %}</td></tr>{% endfor %}
</table>{% endblock %}"#;

const GROUPS: &str = r#"{% extends "base.html" %}{% block body %}
{% for g in groups %}<h2>{{ g.name }} <small>({{ g.id }}, {{ g.strategy }}, {{ g.status }})</small></h2>
<table><tr><th>bundle</th><th>asks</th><th>node</th><th>reserved</th><th>GPUs</th></tr>
{% for b in g.bundles %}<tr><td>{{ b.index }}</td><td>{{ b.asks }}</td><td>{{ b.node }}</td><td>{{ b.reserved }}</td><td>{{ b.gpus }}</td></tr>{% endfor %}
</table>{% else %}<p>No placement groups.</p>{% endfor %}
{% endblock %}"#;

const JOBS: &str = r#"{% extends "base.html" %}{% block body %}
<table><tr><th>job</th><th>name</th><th>state</th><th>arguments</th></tr>
{% for j in jobs %}<tr><td>{{ j.job }}</td><td><a href="/jobs/{{ j.submission_id | urlencode }}">{{ j.submission_id }}</a></td>
<td>{{ j.state }}</td><td>{{ j.args | join(' ') }}</td></tr>{% else %}<tr><td colspan="4">No submitted jobs.</td></tr>{% endfor %}
</table>{% endblock %}"#;

const LOG: &str = r#"{% extends "base.html" %}{% block body %}
<p>{{ about }}</p>
<pre>{{ text }}</pre>
{% endblock %}"#;

const OBJECTS: &str = r#"{% extends "base.html" %}{% block body %}
{% for n in nodes %}<h2>{{ n.node }}</h2>
<p>{{ n.objects }} objects: {{ n.in_memory }} B in memory of {{ n.capacity }} B, {{ n.spilled }} B spilled, {{ n.pinned }} pinned</p>
<table><tr><th>object</th><th>size (B)</th><th>state</th><th>owner</th><th>holders</th></tr>
{% for o in n.rows %}<tr><td>{{ o.id }}</td><td>{{ o.size }}</td><td>{{ o.state }}</td><td>{{ o.owner }}</td><td>{{ o.holders }}</td></tr>{% endfor %}
</table>{% else %}<p>No node answered.</p>{% endfor %}
{% endblock %}"#;

const PANEL: &str = r#"{% extends "base.html" %}{% block body %}{{ body | safe }}{% endblock %}"#;

/// The dashboard's templates.
pub(super) fn templates() -> Result<Environment<'static>> {
    let mut env = Environment::new();
    for (name, source) in [
        ("base.html", BASE),
        ("overview.html", OVERVIEW),
        ("nodes.html", NODES),
        ("actors.html", ACTORS),
        ("groups.html", GROUPS),
        ("jobs.html", JOBS),
        ("log.html", LOG),
        ("objects.html", OBJECTS),
        ("panel.html", PANEL),
    ] {
        env.add_template(name, source)
            .map_err(|e| Error::System(format!("dashboard template {name}: {e}")))?;
    }
    Ok(env)
}

#[derive(Serialize)]
struct NavLink {
    href: String,
    title: String,
    here: bool,
}

fn nav(state: &AppState, here: &str) -> Vec<NavLink> {
    let mut links: Vec<NavLink> = [
        ("/", "Overview"),
        ("/nodes", "Nodes"),
        ("/actors", "Actors"),
        ("/placement-groups", "Placement groups"),
        ("/jobs", "Jobs"),
        ("/objects", "Objects"),
    ]
    .into_iter()
    .map(|(href, title)| NavLink { href: href.into(), title: title.into(), here: href == here })
    .collect();
    for (index, panel) in state.panels.iter().enumerate() {
        let href = format!("/panels/{index}");
        links.push(NavLink { here: href == here, href, title: panel.title() });
    }
    links
}

fn render(
    state: &AppState,
    template: &str,
    here: &str,
    title: &str,
    page: minijinja::Value,
) -> Result<String> {
    let template = state
        .templates
        .get_template(template)
        .map_err(|e| Error::System(format!("dashboard: {e}")))?;
    let nav = Value::from(minijinja::value::Serde(nav(state, here)));
    template
        .render(context! { title, nav, ..page })
        .map_err(|e| Error::System(format!("dashboard: rendering {here}: {e}")))
}

fn runtime() -> Result<&'static Arc<Runtime>> {
    crate::runtime::current()
}

fn resources(map: &BTreeMap<String, f64>) -> String {
    map.iter().map(|(k, v)| format!("{k}: {v}")).collect::<Vec<_>>().join(", ")
}

#[derive(Serialize, Default)]
struct ActorCounts {
    alive: usize,
    pending: usize,
    dead: usize,
}

/// One of the fixed pages.
pub(super) fn render_page(state: &AppState, name: &str) -> Result<String> {
    let rt = runtime()?;
    match name {
        "overview" => {
            let info = rt.cluster_info()?;
            let mut actors = ActorCounts::default();
            for a in rt.list_actors()? {
                match a.state.split(' ').next().unwrap_or_default() {
                    "ALIVE" => actors.alive += 1,
                    "DEAD" => actors.dead += 1,
                    _ => actors.pending += 1,
                }
            }
            let alive_nodes = info.nodes.iter().filter(|n| n.alive).count();
            let page = context! {
                alive_nodes,
                dead_nodes => info.nodes.len() - alive_nodes,
                actors => Value::from(minijinja::value::Serde(&actors)),
                groups => rt.list_placement_groups()?.len(),
                jobs => rt.list_jobs()?.len(),
                info => Value::from(minijinja::value::Serde(&info)),
            };
            render(state, "overview.html", "/", "Cluster overview", page)
        }
        "nodes" => {
            let nodes: Vec<_> = rt
                .cluster_info()?
                .nodes
                .into_iter()
                .map(|n| {
                    context! {
                        node => n.node.to_string(), name => n.name, alive => n.alive,
                        death_reason => n.death_reason, address => n.address.to_string(),
                        total => resources(&n.total), available => resources(&n.available),
                    }
                })
                .collect();
            render(state, "nodes.html", "/nodes", "Nodes", context! { nodes })
        }
        "actors" => {
            let actors: Vec<_> = rt
                .list_actors()?
                .into_iter()
                .map(|a| {
                    context! {
                        actor => a.actor.to_string(), type_name => short_type(&a.type_name).to_owned(),
                        name => a.name, detached => a.detached, state => a.state,
                        node => a.node.map(|n| n.to_string()), pid => a.pid,
                        restarts => a.restarts, worker => a.worker.map(|w| w.to_string()),
                    }
                })
                .collect();
            render(state, "actors.html", "/actors", "Actors", context! { actors })
        }
        "groups" => {
            let groups: Vec<_> = rt
                .list_placement_groups()?
                .into_iter()
                .map(|g| {
                    let placed = g.table.as_ref().map(|t| t.bundles.clone()).unwrap_or_default();
                    let bundles: Vec<_> = g
                        .bundles
                        .iter()
                        .enumerate()
                        .map(|(index, asks)| {
                            let at = placed.iter().find(|b| b.index == index);
                            context! {
                                index,
                                asks => asks.to_string(),
                                node => at.map(|b| b.node.to_string()).unwrap_or_else(|| "pending".into()),
                                reserved => at.map(|b| b.resources.to_string()).unwrap_or_default(),
                                gpus => at.map(|b| format!("{:?}", b.gpu_indices())).unwrap_or_default(),
                            }
                        })
                        .collect();
                    context! {
                        name => g.name, id => g.id.to_string(), strategy => format!("{:?}", g.strategy),
                        status => format!("{:?}", g.status), bundles,
                    }
                })
                .collect();
            let page = context! { groups };
            render(state, "groups.html", "/placement-groups", "Placement groups", page)
        }
        "jobs" => {
            let jobs: Vec<_> = rt
                .list_jobs()?
                .into_iter()
                .map(|j| {
                    context! {
                        job => j.job, submission_id => j.submission_id,
                        state => j.state.to_string(), args => j.args,
                    }
                })
                .collect();
            render(state, "jobs.html", "/jobs", "Jobs", context! { jobs })
        }
        "objects" => {
            let mut nodes = Vec::new();
            for node in rt.cluster_info()?.nodes.iter().filter(|n| n.alive) {
                let Some(stats) = store_stats(rt, node)? else { continue };
                let rows: Vec<_> = stats
                    .per_object
                    .iter()
                    .take(200)
                    .map(|o| {
                        context! {
                            id => o.id.to_string(), size => o.size, state => o.state.as_str(),
                            owner => o.owner.0, holders => o.holders,
                        }
                    })
                    .collect();
                nodes.push(context! {
                    node => format!("{} ({})", node.node, node.name), objects => stats.objects,
                    in_memory => stats.bytes_in_memory, capacity => stats.capacity,
                    spilled => stats.bytes_spilled, pinned => stats.pinned_objects, rows,
                });
            }
            render(state, "objects.html", "/objects", "Objects", context! { nodes })
        }
        other => Err(Error::Invalid(format!("no dashboard page `{other}`"))),
    }
}

/// A node's store: asked in this process when it is the node, else over the network.
fn store_stats(
    rt: &Arc<Runtime>,
    node: &NodeInfo,
) -> Result<Option<rtrun_object_store::StoreStats>> {
    if node.node == rt.node() {
        return rt.node_store_stats();
    }
    let request = ask::NodeStoreStats { holder: rtrun_proto::address::holder_of(rt.worker_id) };
    on_node(rt, node, request).map(|memory| Some(memory.stats))
}

/// A request to `node`'s daemon (this process's own node answers in-process).
fn on_node<A: Ask>(rt: &Arc<Runtime>, node: &NodeInfo, request: A) -> Result<A::Reply> {
    if node.node == rt.node() {
        return rt.ask(To::Node, request);
    }
    let conn = rt.endpoint().connect(&node.address)?;
    rt.ask(To::Peer(&conn), request)
}

/// The end of log `file` on `node`.
fn log_tail(rt: &Arc<Runtime>, node: &NodeInfo, file: &str) -> Result<String> {
    let read = |offset: u64| -> Result<(Vec<u8>, u64)> {
        let request = ask::ReadLog { file: file.to_owned(), offset };
        let LogChunk { bytes, size, .. } = on_node(rt, node, request)?;
        Ok((bytes, size))
    };
    let (first, size) = read(0)?;
    let bytes = if size <= first.len() as u64 { first } else { read(size - LOG_TAIL.min(size))?.0 };
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// An actor's log (its worker's, the newest incarnation).
pub(super) fn render_actor_log(state: &AppState, id: &str) -> Result<String> {
    let rt = runtime()?;
    let actor = rt
        .list_actors()?
        .into_iter()
        .find(|a| a.actor.to_string() == id)
        .ok_or_else(|| Error::Invalid(format!("no actor `{id}` (see /actors)")))?;
    let (Some(worker), Some(log_node)) = (actor.worker, actor.log_node) else {
        return Err(Error::Invalid(format!("actor {id} has not started a worker yet")));
    };
    let node =
        rt.cluster_info()?.nodes.into_iter().find(|n| n.node == log_node && n.alive).ok_or_else(
            || Error::Invalid(format!("the node of {id}'s log ({log_node}) is gone")),
        )?;
    let file = format!("worker-{}.log", worker.0);
    let text = log_tail(rt, &node, &file)?;
    let about = format!(
        "{} {} — {file} on {} ({}), {}; the last {} KiB",
        short_type(&actor.type_name),
        actor.name.unwrap_or_default(),
        node.node,
        node.name,
        actor.state,
        LOG_TAIL >> 10
    );
    let title = format!("Log of {id}");
    render(state, "log.html", "/actors", &title, context! { about, text, refresh => 3 })
}

/// A job's live log.
pub(super) fn render_job(state: &AppState, name: &str) -> Result<String> {
    let rt = runtime()?;
    let job = rt
        .list_jobs()?
        .into_iter()
        .find(|j| j.submission_id == name || j.job.to_string() == name)
        .ok_or_else(|| Error::Invalid(format!("no job `{name}` (see /jobs)")))?;
    let mut text = Vec::new();
    let mut offset = 0;
    loop {
        let JobOutput { bytes, .. } = rt.ask(To::Head, ask::JobLogs { job: job.job, offset })?;
        if bytes.is_empty() {
            break;
        }
        offset += bytes.len() as u64;
        text.extend_from_slice(&bytes);
        let keep = text.len().saturating_sub(LOG_TAIL as usize);
        text.drain(..keep);
    }
    let about = format!("job {} ({}): {}", job.job, job.submission_id, job.state);
    let title = format!("Job {}", job.submission_id);
    let text = String::from_utf8_lossy(&text).into_owned();
    render(state, "log.html", "/jobs", &title, context! { about, text, refresh => 2 })
}

/// An embedder's page.
pub(super) fn render_panel(state: &AppState, index: usize) -> Result<String> {
    let panel = state
        .panels
        .get(index)
        .ok_or_else(|| Error::Invalid(format!("no dashboard panel {index}")))?;
    let here = format!("/panels/{index}");
    let title = panel.title();
    render(state, "panel.html", &here, &title, context! { body => panel.body_html() })
}
