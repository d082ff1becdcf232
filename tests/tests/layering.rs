//! Tidy check of the module layering: inside each crate, the modules import one way.
//!
//! A module *imports* another when its code (tests and comments left out) names a path into
//! it: `crate::a::b::Item`, `super::x`, `self::y`, or an item of a `use crate::{…}` group. A
//! path resolves to the longest module prefix it names; paths to the crate root (its
//! re-exports) are left out, as the root only gathers. An *import circle* is a strongly
//! connected set of such modules: a reader who follows imports from any of them can come back
//! to it. No circle may span more than [`MAX_CIRCLE`] files, except the ones listed in
//! [`KNOWN_CIRCLES`], which may not grow.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The largest import circle a crate may have, in files.
const MAX_CIRCLE: usize = 3;

/// Source directories with a larger circle today, and its size: each may shrink (lower the
/// number when it does) and never grow. `runtime/src` and `rlhf/train/src` are held to
/// [`MAX_CIRCLE`] like every other crate.
const KNOWN_CIRCLES: [(&str, usize); 2] = [("runtime/net/src", 4), ("rlhf/model/src", 6)];

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A module's path from its crate root (`a/b.rs` and `a/b/mod.rs` are `["a", "b"]`).
type ModulePath = Vec<String>;

/// The modules of the source directory `src` (binaries and the crate root left out), each with
/// its file relative to `src`.
fn modules(src: &Path) -> BTreeMap<ModulePath, String> {
    let mut out = BTreeMap::new();
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        for entry in std::fs::read_dir(src.join(&rel)).expect("reading a source directory") {
            let entry = entry.expect("a directory entry");
            let name = entry.file_name().to_string_lossy().into_owned();
            let path = rel.join(&name);
            if entry.file_type().expect("a file type").is_dir() {
                if !(rel.as_os_str().is_empty() && name == "bin") {
                    stack.push(path);
                }
                continue;
            }
            let Some(stem) = name.strip_suffix(".rs") else { continue };
            let mut module: ModulePath =
                rel.components().map(|c| c.as_os_str().to_string_lossy().into_owned()).collect();
            if stem != "mod" {
                module.push(stem.to_owned());
            }
            let root_file = rel.as_os_str().is_empty() && (stem == "lib" || stem == "main");
            if !root_file {
                out.insert(module, path.to_string_lossy().replace('\\', "/"));
            }
        }
    }
    out
}

/// The code of a file: everything before its first `#[cfg(test)]`, without `//` comments.
fn code(text: &str) -> String {
    // A test-only module declared in the file (`#[cfg(test)] mod sim;`) is skipped; any other
    // `#[cfg(test)]` starts the file's tests, which run to its end.
    let mut rest = text;
    let mut kept = String::new();
    while let Some(at) = rest.find("#[cfg(test)]") {
        kept.push_str(&rest[..at]);
        let after = rest[at + "#[cfg(test)]".len()..].trim_start();
        let line = after.lines().next().unwrap_or_default().trim_end();
        if !(line.starts_with("mod ") && line.ends_with(';')) {
            rest = "";
            break;
        }
        rest = &after[line.len()..];
    }
    kept.push_str(rest);
    let text = kept;
    text.lines()
        .map(|line| line.split("//").next().unwrap_or_default())
        .collect::<Vec<_>>()
        .join("\n")
}

/// The identifier path that starts at `at` (`a::b::C`), stopping before a `{` group.
fn path_at(text: &str, at: usize) -> Vec<String> {
    let rest = &text[at..];
    let end =
        rest.find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':')).unwrap_or(rest.len());
    rest[..end].split("::").filter(|s| !s.is_empty()).map(str::to_owned).collect()
}

/// The top-level items of the `{…}` group that starts at `open`, each as its leading path
/// (`f::{g, h}` is `f`).
fn group_items(text: &str, open: usize) -> Vec<Vec<String>> {
    let mut items = Vec::new();
    let mut depth = 0;
    let mut start = open + 1;
    for (i, c) in text[open..].char_indices().map(|(i, c)| (open + i, c)) {
        match c {
            '{' => depth += 1,
            '}' | ',' if depth == 1 => {
                let item = &text[start..i];
                let lead = start + (item.len() - item.trim_start().len());
                items.push(path_at(text, lead));
                start = i + 1;
                if c == '}' {
                    break;
                }
            }
            '}' => depth -= 1,
            _ => {}
        }
    }
    items.into_iter().filter(|p| !p.is_empty()).collect()
}

/// The paths a file names from `crate::`, `super::` or `self::`, made absolute from the crate
/// root, for the module `module`.
fn named_paths(code: &str, module: &[String]) -> Vec<ModulePath> {
    let mut out = Vec::new();
    for keyword in ["crate::", "super::", "self::"] {
        for (at, _) in code.match_indices(keyword) {
            let before = code[..at].chars().next_back();
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
                continue;
            }
            let mut base: ModulePath = match keyword {
                "crate::" => Vec::new(),
                "super::" => module[..module.len().saturating_sub(1)].to_vec(),
                _ => module.to_vec(),
            };
            let mut path = path_at(code, at + keyword.len());
            while path.first().is_some_and(|s| s == "super") {
                path.remove(0);
                base.pop();
            }
            let end = at + keyword.len() + path.iter().map(|s| s.len() + 2).sum::<usize>();
            if code[end.min(code.len())..].starts_with('{') {
                for item in group_items(code, end) {
                    out.push(base.iter().chain(&path).chain(&item).cloned().collect());
                }
            } else {
                out.push(base.iter().chain(&path).cloned().collect());
            }
        }
    }
    out
}

/// Each module's imports among the modules of `src`.
fn import_graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let modules = modules(src);
    let resolve =
        |path: &[String]| (1..=path.len()).rev().find_map(|n| modules.get(&path[..n]).cloned());
    modules
        .iter()
        .map(|(module, file)| {
            let text = std::fs::read_to_string(src.join(file)).expect("reading a source file");
            let imports = named_paths(&code(&text), module)
                .iter()
                .filter_map(|path| resolve(path))
                .filter(|target| target != file)
                .collect();
            (file.clone(), imports)
        })
        .collect()
}

/// The strongly connected sets of `graph` with more than one member (Tarjan's algorithm).
fn circles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<BTreeSet<String>> {
    struct State<'a> {
        graph: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        found: Vec<BTreeSet<String>>,
    }
    fn visit<'a>(s: &mut State<'a>, v: &'a str) {
        let n = s.index.len();
        s.index.insert(v, n);
        s.low.insert(v, n);
        s.stack.push(v);
        s.on_stack.insert(v);
        for w in s.graph.get(v).into_iter().flatten() {
            if !s.index.contains_key(w.as_str()) {
                visit(s, w);
                let low = s.low[v].min(s.low[w.as_str()]);
                s.low.insert(v, low);
            } else if s.on_stack.contains(w.as_str()) {
                let low = s.low[v].min(s.index[w.as_str()]);
                s.low.insert(v, low);
            }
        }
        if s.low[v] == s.index[v] {
            let mut set = BTreeSet::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack.remove(w);
                set.insert(w.to_owned());
                if w == v {
                    break;
                }
            }
            if set.len() > 1 {
                s.found.push(set);
            }
        }
    }
    let mut state = State {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        found: Vec::new(),
    };
    for v in graph.keys() {
        if !state.index.contains_key(v.as_str()) {
            visit(&mut state, v);
        }
    }
    state.found
}

/// Every crate's source directory (`src/` beside a `Cargo.toml`), relative to the root.
fn source_dirs(root: &Path) -> Vec<String> {
    let members = [
        "runtime",
        "runtime/macros",
        "runtime/net",
        "runtime/proto",
        "runtime/head-core",
        "placement",
        "object-store",
        "tests",
    ];
    let mut dirs: Vec<String> = members.iter().map(|m| format!("{m}/src")).collect();
    for entry in std::fs::read_dir(root.join("rlhf")).expect("reading rlhf/") {
        let name = entry.expect("a directory entry").file_name().to_string_lossy().into_owned();
        if root.join("rlhf").join(&name).join("src").is_dir() {
            dirs.push(format!("rlhf/{name}/src"));
        }
    }
    dirs.sort();
    dirs
}

#[test]
fn modules_import_one_way_inside_each_crate() {
    let root = repo_root();
    let dirs = source_dirs(&root);
    assert!(dirs.len() >= 12, "found only {dirs:?}");
    let mut problems = Vec::new();
    for dir in &dirs {
        let limit = KNOWN_CIRCLES.iter().find(|(d, _)| d == dir).map_or(MAX_CIRCLE, |(_, n)| *n);
        for circle in circles(&import_graph(&root.join(dir))) {
            if circle.len() > limit {
                problems.push(format!(
                    "{dir}: an import circle of {} files (at most {limit}): {circle:?}",
                    circle.len()
                ));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "modules that import each other in a circle:\n{}",
        problems.join("\n")
    );
}

/// The leaf crates and the only crates each may depend on (its `[dependencies]`): the wire
/// types need serde, the error derive and the placement and store types they carry; the head
/// core the wire types, the placement state machine, serde (its durable records) and the
/// `tracing` facade (the shell's subscriber writes).
const LEAF_CRATES: [(&str, &[&str]); 2] = [
    (
        "runtime/proto",
        &["rtrun-placement", "rtrun-object-store", "serde", "serde_bytes", "thiserror"],
    ),
    ("runtime/head-core", &["rtrun-proto", "rtrun-placement", "serde", "tracing"]),
];

/// What the head core's sources may not name: it does no I/O, keeps no clock and takes no
/// lock (the shell does all three).
const NO_IO: [&str; 13] = [
    "tokio",
    "std::fs",
    "std::io",
    "std::process",
    "std::thread",
    "std::env",
    "std::os",
    "std::sync",
    "parking_lot",
    "Instant",
    "SystemTime",
    "TcpStream",
    "UnixStream",
];

/// The crates a manifest's `[dependencies]` names (dev-dependencies left out); any other
/// dependency table (a target's, a build's) counts too.
fn dependencies(manifest: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut inside = false;
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            inside = line.ends_with("dependencies]") && line != "[dev-dependencies]";
            continue;
        }
        if inside && !line.is_empty() && !line.starts_with('#') {
            let name = line.split(['=', '.', ' ']).next().unwrap_or_default();
            out.push(name.to_owned());
        }
    }
    out
}

/// The leaf crates depend on their lists only, and the head core names no I/O.
#[test]
fn the_leaf_crates_keep_to_their_dependencies_and_the_core_does_no_io() {
    let root = repo_root();
    for (dir, allowed) in LEAF_CRATES {
        let manifest = std::fs::read_to_string(root.join(dir).join("Cargo.toml"))
            .expect("reading a leaf crate's manifest");
        let found = dependencies(&manifest);
        assert!(!found.is_empty(), "{dir}: no dependencies found");
        for dep in &found {
            assert!(allowed.contains(&dep.as_str()), "{dir} depends on {dep}, not on its list");
        }
    }
    let src = root.join("runtime/head-core/src");
    let mut files = 0;
    for entry in std::fs::read_dir(&src).expect("reading the head core") {
        let path = entry.expect("an entry").path();
        // The simulator is the core's test; it runs the core, and may keep time as it likes.
        if path.file_name().is_some_and(|n| n == "sim.rs") {
            continue;
        }
        let text = code(&std::fs::read_to_string(&path).expect("reading a source file"));
        for word in NO_IO {
            assert!(!text.contains(word), "{}: names `{word}`", path.display());
        }
        files += 1;
    }
    assert!(files >= 5, "found only {files} head core files");
    let manifest = "[dependencies]\na.workspace = true\nb = \"1\"\n# c\n[dev-dependencies]\nd = 1\n\
                    [target.'cfg(unix)'.dependencies]\ne = 1";
    assert_eq!(dependencies(manifest), ["a", "b", "e"]);
}

/// The known circles are as large as listed: a smaller one means the limit can come down.
#[test]
fn the_known_circles_are_as_large_as_listed() {
    let root = repo_root();
    for (dir, size) in KNOWN_CIRCLES {
        let largest = circles(&import_graph(&root.join(dir))).iter().map(BTreeSet::len).max();
        assert_eq!(largest, Some(size), "{dir}: lower its KNOWN_CIRCLES entry to {largest:?}");
    }
}

/// The parser sees every kind of path the check relies on, and the circle finder finds
/// exactly the strongly connected sets.
#[test]
fn the_layering_check_sees_what_it_looks_for() {
    let module = vec!["a".to_owned(), "b".to_owned()];
    let code = code(
        "use crate::x::Y;\nuse super::c;\nuse crate::{d::E, f::{g, h}, i};\n// crate::comment\n\
         fn f() { self::k::f(); super::super::top(); my_crate::no(); }\n#[cfg(test)]\nuse crate::t;",
    );
    let paths: BTreeSet<String> =
        named_paths(&code, &module).iter().map(|p| p.join("::")).collect();
    let expected = ["x::Y", "a::c", "d::E", "f", "i", "a::b::k::f", "top"];
    assert_eq!(paths, expected.iter().map(|s| s.to_string()).collect());
    let graph: BTreeMap<String, BTreeSet<String>> = [
        ("a", &["b"][..]),
        ("b", &["c"]),
        ("c", &["a", "d"]),
        ("d", &["e"]),
        ("e", &["d"]),
        ("f", &["a"]),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), v.iter().map(|s| s.to_string()).collect()))
    .collect();
    let mut found: Vec<Vec<String>> =
        circles(&graph).into_iter().map(|c| c.into_iter().collect()).collect();
    found.sort();
    assert_eq!(found, [vec!["a", "b", "c"], vec!["d", "e"]]);
}
