//! Tidy checks over the repository's own text (as rust-analyzer's `tidy` test does), so the
//! documented boundaries cannot drift from the code unnoticed:
//! - every Rust file starts with its module doc (`//!`);
//! - every repository path ARCHITECTURE.md, `docs/code-map.md` and the decision records
//!   (`docs/decisions/`) name in backticks exists, the decision index links every record and
//!   only existing ones, and README.md and ARCHITECTURE.md stay under 15 KB;
//! - nothing committed is run output (no `.pyc`, no `runs/` or `__pycache__/` directory, model
//!   weights only in the parity fixtures), and no tracked text reaches outside the repository
//!   (the `shared/` directory beside a checkout is not part of a clone);
//! - `unsafe` code appears only in the files of ARCHITECTURE.md's allow-list ("## `unsafe`
//!   allow-list"), every file listed there still has some, only listed files
//!   `allow(unsafe_code)` (the crates deny it), and every `unsafe` block or impl has a
//!   `// SAFETY:` comment just above it.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The repository's files and directories (relative, `/`-separated; directories end in `/`),
/// without build outputs, VCS data, caches and hidden entries.
fn tree(root: &Path) -> (Vec<String>, BTreeSet<String>) {
    let mut files = Vec::new();
    let mut dirs = BTreeSet::new();
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let entries = std::fs::read_dir(root.join(&rel)).expect("reading a directory");
        for entry in entries {
            let entry = entry.expect("a directory entry");
            let name = entry.file_name().to_string_lossy().into_owned();
            let skipped = name.starts_with('.')
                || name.starts_with("target")
                || name == "node_modules"
                || name == "__pycache__"
                || name == "runs";
            if skipped {
                continue;
            }
            let path = rel.join(&name);
            let text = path.to_string_lossy().replace('\\', "/");
            let kind = entry.file_type().expect("a file type");
            if kind.is_dir() {
                dirs.insert(format!("{text}/"));
                stack.push(path);
            } else if kind.is_file() {
                files.push(text);
            }
        }
    }
    files.sort();
    (files, dirs)
}

fn read(root: &Path, rel: &str) -> String {
    std::fs::read_to_string(root.join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

#[test]
fn every_rust_file_starts_with_its_module_doc() {
    let root = repo_root();
    let (files, _) = tree(&root);
    let missing: Vec<&String> = files
        .iter()
        .filter(|f| f.ends_with(".rs"))
        .filter(|f| {
            let text = read(&root, f);
            !text.lines().find(|l| !l.trim().is_empty()).is_some_and(|l| l.starts_with("//!"))
        })
        .collect();
    assert!(missing.is_empty(), "files without a `//!` module doc at the top: {missing:?}");
}

/// The backticked words of `text` that name a repository path: a file with one of the
/// repository's extensions or a directory (`…/`), relative, without placeholders.
fn named_paths(text: &str) -> BTreeSet<String> {
    const EXTENSIONS: [&str; 8] = [".rs", ".md", ".sh", ".yaml", ".yml", ".toml", ".py", ".json"];
    text.split('`')
        .skip(1)
        .step_by(2)
        .map(|t| t.trim_end_matches([':', ',', '.']))
        .filter(|t| !t.is_empty() && !t.contains(char::is_whitespace))
        .filter(|t| EXTENSIONS.iter().any(|e| t.ends_with(e)) || (t.ends_with('/') && t.len() > 1))
        .filter(|t| !t.contains(['<', '>', '*', '{', '}', '(', ')', '|', '…', '$', '~']))
        .filter(|t| !t.starts_with(['/', '.']) && !t.starts_with("target"))
        .map(str::to_owned)
        .collect()
}

/// The targets of `text`'s relative Markdown links (`[label](path)`).
fn linked_paths(text: &str) -> BTreeSet<String> {
    text.split("](")
        .skip(1)
        .filter_map(|rest| rest.split(')').next())
        .filter(|target| !target.contains("://") && !target.starts_with('#'))
        .map(|target| target.split('#').next().unwrap_or_default().to_owned())
        .collect()
}

/// The decision index: every record is listed there.
const DECISIONS_INDEX: &str = "docs/decisions/README.md";
/// The file-by-file companion of ARCHITECTURE.md's code map.
const CODE_MAP: &str = "docs/code-map.md";

#[test]
fn every_path_architecture_md_the_code_map_and_the_decisions_name_exists() {
    let root = repo_root();
    let (files, dirs) = tree(&root);
    // A path names a file or directory from the root, or the tail of one (`head/spawn.rs`
    // inside the section about `runtime/src/`).
    let exists = |path: &str| {
        let tail = format!("/{path}");
        files.iter().any(|f| f == path || f.ends_with(&tail))
            || dirs.iter().any(|d| d == path || d.ends_with(&tail))
    };
    let architecture = read(&root, "ARCHITECTURE.md");
    let maps = linked_paths(&architecture);
    for linked in [DECISIONS_INDEX, CODE_MAP] {
        assert!(maps.contains(linked), "ARCHITECTURE.md does not link {linked}");
    }
    // The index links its records relative to its own directory.
    let links: BTreeSet<String> = linked_paths(&read(&root, DECISIONS_INDEX))
        .into_iter()
        .filter(|l| !l.starts_with("../"))
        .map(|l| format!("docs/decisions/{l}"))
        .collect();
    assert!(links.len() > 40, "{DECISIONS_INDEX} links {} decisions", links.len());
    let dead: Vec<&String> = links.iter().filter(|l| !files.contains(l)).collect();
    assert!(dead.is_empty(), "{DECISIONS_INDEX} links files that do not exist: {dead:?}");
    let decisions: Vec<&String> = files
        .iter()
        .filter(|f| f.starts_with("docs/decisions/") && f.ends_with(".md"))
        .filter(|f| f.as_str() != DECISIONS_INDEX)
        .collect();
    let unlisted: Vec<&&String> = decisions.iter().filter(|d| !links.contains(**d)).collect();
    assert!(unlisted.is_empty(), "decisions {DECISIONS_INDEX} does not list: {unlisted:?}");
    let mut named = 0;
    let maps = ["ARCHITECTURE.md".to_owned(), CODE_MAP.to_owned()];
    for doc in maps.iter().chain(decisions.iter().copied()) {
        let paths = named_paths(&read(&root, doc));
        named += paths.len();
        let stale: Vec<&String> = paths.iter().filter(|p| !exists(p)).collect();
        assert!(stale.is_empty(), "{doc} names paths that do not exist: {stale:?}");
    }
    assert!(named > 50, "found only {named} paths");
}

/// The two maps a newcomer reads first stay short: the details live in `docs/`.
#[test]
fn readme_and_architecture_stay_short() {
    let root = repo_root();
    for doc in ["README.md", "ARCHITECTURE.md"] {
        let size = read(&root, doc).len();
        assert!(size <= 15 * 1024, "{doc} is {size} bytes, more than 15 KB: move details to docs/");
    }
}

/// Whether the code part of `line` (before a `//` comment) has `unsafe` code: a block, a
/// function, an impl, an extern block or an unsafe attribute. Returns the kind.
fn unsafe_code(line: &str) -> Option<&'static str> {
    let code = code_part(line);
    if code.contains("#[unsafe(") {
        return Some("attribute");
    }
    let mut rest = code.as_str();
    while let Some(at) = rest.find("unsafe") {
        let before = rest[..at].chars().next_back();
        let after = rest[at + "unsafe".len()..].trim_start();
        let word_start = !before.is_some_and(|c| c.is_alphanumeric() || c == '_');
        if word_start {
            for (prefix, kind) in
                [("{", "block"), ("impl", "impl"), ("fn", "fn"), ("extern", "extern")]
            {
                if after.starts_with(prefix) {
                    return Some(kind);
                }
            }
        }
        rest = &rest[at + "unsafe".len()..];
    }
    None
}

/// `line` without its string literals' contents and its `//` comment.
fn code_part(line: &str) -> String {
    let mut code = String::new();
    let mut chars = line.chars().peekable();
    let mut in_string = false;
    while let Some(c) = chars.next() {
        match (in_string, c) {
            (true, '\\') => {
                chars.next();
            }
            (true, '"') => {
                in_string = false;
                code.push(c);
            }
            (true, _) => {}
            (false, '"') => {
                in_string = true;
                code.push(c);
            }
            (false, '/') if chars.peek() == Some(&'/') => break,
            (false, _) => code.push(c),
        }
    }
    code
}

/// The files ARCHITECTURE.md's "## `unsafe` allow-list" section lists (`- `path`: why`).
fn allow_list(architecture: &str) -> BTreeSet<String> {
    let section = architecture
        .split("\n## ")
        .find(|s| s.starts_with("`unsafe` allow-list"))
        .expect("ARCHITECTURE.md has a \"## `unsafe` allow-list\" section");
    section
        .lines()
        .filter_map(|l| l.strip_prefix("- `")?.split('`').next())
        .map(str::to_owned)
        .collect()
}

#[test]
fn unsafe_code_is_only_where_architecture_md_allows_it_and_says_why() {
    let root = repo_root();
    let (files, _) = tree(&root);
    let allowed = allow_list(&read(&root, "ARCHITECTURE.md"));
    let mut found = BTreeSet::new();
    let mut allowing = BTreeSet::new();
    let mut undocumented = Vec::new();
    for file in files.iter().filter(|f| f.ends_with(".rs")) {
        let text = read(&root, file);
        let lines: Vec<&str> = text.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            if code_part(line).contains("allow(unsafe_code)") {
                allowing.insert(file.clone());
            }
            let Some(kind) = unsafe_code(line) else { continue };
            found.insert(file.clone());
            // A block or impl states its proof obligation right above it (or on its line).
            if matches!(kind, "block" | "impl") {
                let above = &lines[i.saturating_sub(6)..=i];
                if !above.iter().any(|l| l.contains("SAFETY:")) {
                    undocumented.push(format!("{file}:{}", i + 1));
                }
            }
        }
    }
    let unlisted: Vec<&String> = found.difference(&allowed).collect();
    let stale: Vec<&String> = allowed.difference(&found).collect();
    assert!(unlisted.is_empty(), "unsafe code outside ARCHITECTURE.md's allow-list: {unlisted:?}");
    assert!(stale.is_empty(), "listed as holding unsafe code but holding none: {stale:?}");
    assert!(undocumented.is_empty(), "unsafe without a `// SAFETY:` comment: {undocumented:?}");
    // The crates deny `unsafe_code`; the files that allow it are the listed ones.
    let stray: Vec<&String> = allowing.difference(&allowed).collect();
    assert!(stray.is_empty(), "`allow(unsafe_code)` outside the allow-list: {stray:?}");
}

#[test]
fn the_checks_see_what_they_look_for() {
    assert_eq!(unsafe_code("    unsafe { libc::kill(1, 9) };"), Some("block"));
    assert_eq!(unsafe_code("unsafe impl Send for Arena {}"), Some("impl"));
    assert_eq!(unsafe_code("pub unsafe fn map(&self) {"), Some("fn"));
    assert_eq!(unsafe_code("#[unsafe(no_mangle)]"), Some("attribute"));
    assert_eq!(unsafe_code("// unsafe { in a comment }"), None);
    assert_eq!(unsafe_code("#![forbid(unsafe_code)]"), None);
    assert_eq!(unsafe_code("let not_unsafe = 1; // no `unsafe` here"), None);
    assert_eq!(unsafe_code("let s = \"unsafe { \\\" }\"; // a string"), None);
    let named = named_paths("see `runtime/src/lib.rs`, `head/` and `cargo test`, `<dir>/x.rs`");
    assert_eq!(named, BTreeSet::from(["runtime/src/lib.rs".into(), "head/".into()]));
    let links = linked_paths("[001](docs/decisions/001-a.md): A, [web](https://x.org/a.md)");
    assert_eq!(links, BTreeSet::from(["docs/decisions/001-a.md".into()]));
    let list = allow_list(
        "# A\n\n## `unsafe` allow-list\n\n- `a/b.rs`: why\n- `c.rs` — why\n\n## B\n- `d.rs`\n",
    );
    assert_eq!(list, BTreeSet::from(["a/b.rs".into(), "c.rs".into()]));
}

/// The tracked files (`git ls-files`): what a clone holds.
fn tracked(root: &Path) -> Vec<String> {
    let out = std::process::Command::new("git")
        .args(["ls-files", "-z"])
        .current_dir(root)
        .output()
        .expect("running git ls-files (the tidy checks need a git checkout)");
    assert!(out.status.success(), "git ls-files: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout)
        .split('\0')
        .filter(|p| !p.is_empty())
        .map(str::to_owned)
        .collect()
}

/// The directories whose committed weights are test fixtures (made by the parity scripts).
const FIXTURE_DIRS: [&str; 1] = ["rlhf/model/parity/"];

#[test]
fn nothing_committed_is_run_output() {
    let files = tracked(&repo_root());
    assert!(files.len() > 100, "git ls-files listed only {} files", files.len());
    let output: Vec<&String> = files
        .iter()
        .filter(|f| {
            let parts: Vec<&str> = f.split('/').collect();
            let weights = [".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf"]
                .iter()
                .any(|e| f.ends_with(e));
            f.ends_with(".pyc")
                || parts.contains(&"runs")
                || parts.contains(&"__pycache__")
                || (weights && !FIXTURE_DIRS.iter().any(|d| f.starts_with(d)))
        })
        .collect();
    assert!(output.is_empty(), "run output committed: {output:?}");
}

#[test]
fn no_tracked_text_reaches_outside_the_repository() {
    let root = repo_root();
    // Built at run time so this file does not match itself.
    let needle = format!("{}/shared/", "..");
    let texts = [".rs", ".md", ".sh", ".py", ".yaml", ".yml", ".toml", ".json"];
    let reaching: Vec<String> = tracked(&root)
        .iter()
        .filter(|f| texts.iter().any(|e| f.ends_with(e)))
        .filter_map(|f| {
            let text = std::fs::read_to_string(root.join(f)).ok()?;
            let line = text.lines().position(|l| l.contains(&needle))?;
            Some(format!("{f}:{}", line + 1))
        })
        .collect();
    assert!(reaching.is_empty(), "paths outside the repository (a clone lacks them): {reaching:?}");
}
