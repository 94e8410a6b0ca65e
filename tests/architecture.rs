//! `ARCHITECTURE.md`'s code map against the repository: every source file is named, and every file it names exists.
//!
//! The code map is the part of `ARCHITECTURE.md` between `## Code map` and the next `## ` heading (fenced code
//! blocks are skipped). Each `### ` heading opens with a folder in backticks (`` ### `actors/src/` — … ``; `` `./` ``
//! is the repository root), and that folder must exist; the backticked paths below it, up to the next `### `, name
//! files relative to that folder (`` `block_stack/ring.rs` ``). Brace groups name several files at once:
//! `` `platform/cuda/{driver,resources,mod}.rs` `` (several groups multiply; groups do not nest).
//!
//! Source files are the files git knows or would add (`git ls-files --cached --others --exclude-standard`, so a new
//! file fails the test before it is committed) that exist in the working tree and either have one of the extensions
//! in [`SOURCE_EXTENSIONS`] or have no extension and start with `#!` (scripts such as `.ci/run`), anywhere in the
//! repository: a file outside every heading's folder is as missing as one the map forgets. A backticked span names
//! a file when it is a source file's path (relative to the heading's folder), or when it ends in a source extension;
//! a span of the second kind that is not a source file is stale.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

/// Extensions of the files the code map must name.
const SOURCE_EXTENSIONS: &[&str] = &["rs", "py", "pyi", "sh"];

/// One `### ` section of the code map: its folder (`None` when the heading does not open with one; `""` for the
/// repository root) and the path-like spans below it, each joined to the folder.
#[derive(Debug, Default)]
struct Section {
    heading: String,
    folder: Option<String>,
    spans: BTreeSet<String>,
}

/// The backticked spans of a line.
fn backticked(line: &str) -> Vec<&str> {
    line.split('`').skip(1).step_by(2).collect()
}

/// Expands every brace group of a span: `dir/{a,b}.rs` gives `dir/a.rs`, `dir/b.rs`; `{x,y}/{a,b}.rs` gives four
/// paths. A span without a complete group is returned as it is.
fn expand_braces(span: &str) -> Vec<String> {
    let Some(open) = span.find('{') else { return vec![span.to_string()] };
    let Some(close) = span[open..].find('}').map(|c| open + c) else { return vec![span.to_string()] };
    let (head, tail) = (&span[..open], &span[close + 1..]);
    span[open + 1..close].split(',').flat_map(|alt| expand_braces(&format!("{head}{}{tail}", alt.trim()))).collect()
}

/// Whether a path ends in a source extension.
fn has_source_extension(path: &str) -> bool {
    Path::new(path).extension().and_then(|e| e.to_str()).is_some_and(|e| SOURCE_EXTENSIONS.contains(&e))
}

/// The folder a `### ` heading opens with: its first backticked span, when the heading starts with it.
fn heading_folder(heading: &str) -> Option<String> {
    if !heading.trim_start().starts_with('`') {
        return None;
    }
    let folder = *backticked(heading).first()?;
    let folder = folder.trim_start_matches("./").trim_end_matches('/');
    (!folder.contains(char::is_whitespace)).then(|| folder.to_string())
}

/// Parses the code map of `text` into its sections.
fn code_map(text: &str) -> Vec<Section> {
    let mut sections: Vec<Section> = Vec::new();
    let (mut in_map, mut in_fence) = (false, false);
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            in_fence = !in_fence;
            continue;
        }
        if in_fence {
            continue;
        }
        if let Some(h) = line.strip_prefix("## ") {
            in_map = h.trim() == "Code map";
            continue;
        }
        if !in_map {
            continue;
        }
        if let Some(h) = line.strip_prefix("### ") {
            sections.push(Section { heading: h.trim().to_string(), folder: heading_folder(h), spans: BTreeSet::new() });
            continue;
        }
        let Some(section) = sections.last_mut() else { continue };
        let Some(folder) = &section.folder else { continue };
        for span in backticked(line) {
            for path in expand_braces(span) {
                if path.is_empty() || path.contains(char::is_whitespace) || path.ends_with('/') {
                    continue;
                }
                let full = if folder.is_empty() { path } else { format!("{folder}/{path}") };
                section.spans.insert(full);
            }
        }
    }
    sections
}

/// Whether a file counts as source: a source extension, or no extension and a first line starting with `#!`.
fn is_source(path: &str, first_bytes: impl FnOnce() -> Vec<u8>) -> bool {
    has_source_extension(path) || (Path::new(path).extension().is_none() && first_bytes().starts_with(b"#!"))
}

/// The problems of a code map against the repository's files (`files`: every file, `sources`: the source files
/// among them): a heading without a folder, a heading folder that holds no file, a source file no section names
/// (`missing`), and a named source path that is not a source file (`stale`).
fn check(sections: &[Section], files: &BTreeSet<String>, sources: &BTreeSet<String>) -> Vec<String> {
    let mut problems = Vec::new();
    for section in sections {
        match &section.folder {
            None => problems
                .push(format!("heading without a folder: `### {}` must open with one in backticks", section.heading)),
            Some(folder) if !folder.is_empty() && !files.iter().any(|f| f.starts_with(&format!("{folder}/"))) => {
                problems.push(format!("no such folder: `### {}` names {folder}/, which holds no file", section.heading))
            }
            Some(_) => {}
        }
    }
    let spans: BTreeSet<&String> = sections.iter().flat_map(|s| &s.spans).collect();
    for file in sources {
        if !spans.contains(file) {
            problems.push(format!("missing: {file} is a source file but ARCHITECTURE.md's code map does not name it"));
        }
    }
    for span in spans {
        if has_source_extension(span) && !sources.contains(span) {
            problems.push(format!("stale: ARCHITECTURE.md's code map names {span}, which is not a file"));
        }
    }
    problems
}

/// Every file git knows or would add, as paths from the root, that exists in the working tree.
fn repository_files(root: &Path) -> BTreeSet<String> {
    let out = Command::new("git")
        .arg("-C")
        .arg(root)
        .args(["ls-files", "--cached", "--others", "--exclude-standard"])
        .output()
        .expect("run git ls-files");
    assert!(out.status.success(), "git ls-files failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).lines().filter(|f| root.join(f).is_file()).map(str::to_string).collect()
}

/// The first bytes of a file (empty when it cannot be read).
fn first_bytes(path: &Path) -> Vec<u8> {
    use std::io::Read;
    let mut head = [0u8; 2];
    let n = std::fs::File::open(path).and_then(|mut f| f.read(&mut head)).unwrap_or(0);
    head[..n].to_vec()
}

#[test]
fn the_code_map_names_every_source_file_and_nothing_else() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join("ARCHITECTURE.md")).expect("read ARCHITECTURE.md");
    let files = repository_files(root);
    let sources: BTreeSet<String> =
        files.iter().filter(|f| is_source(f, || first_bytes(&root.join(f)))).cloned().collect();
    assert!(sources.contains("src/lib.rs"), "found no source files under {}", root.display());
    let sections = code_map(&text);
    assert!(sections.len() >= 5, "the code map has {} sections; expected one per crate and more", sections.len());
    let problems = check(&sections, &files, &sources);
    assert!(problems.is_empty(), "ARCHITECTURE.md's code map is out of date:\n{}", problems.join("\n"));
}

fn set(items: &[&str]) -> BTreeSet<String> {
    items.iter().map(|s| s.to_string()).collect()
}

#[test]
fn brace_groups_expand() {
    assert_eq!(
        expand_braces("platform/cuda/{driver, resources,mod}.rs"),
        ["platform/cuda/driver.rs", "platform/cuda/resources.rs", "platform/cuda/mod.rs"]
    );
    assert_eq!(expand_braces("{a,b}/{x,y}.rs"), ["a/x.rs", "a/y.rs", "b/x.rs", "b/y.rs"]);
    assert_eq!(expand_braces("plain.rs"), ["plain.rs"]);
    assert_eq!(expand_braces("open{a,b.rs"), ["open{a,b.rs"]);
}

#[test]
fn headings_open_with_a_folder() {
    assert_eq!(heading_folder(" `actors/src/` — the scheduler"), Some("actors/src".to_string()));
    assert_eq!(heading_folder(" `./` — the root"), Some(String::new()));
    assert_eq!(heading_folder(" Elsewhere: `tests/`"), None);
    assert_eq!(heading_folder(" Elsewhere"), None);
}

#[test]
fn the_check_reports_a_missing_and_a_stale_entry() {
    let text = "# A\n## Code map\n### `lib/` — a crate\n- `a.rs` and `{b,gone}.rs`, `c/` is a folder, `enable` a \
                word, `run` a script\n```\n## not a heading\n- `fenced.rs`\n```\n- `sub/{x,y}.rs`\n\
                ## Invariants\n- `lib/outside.rs`\n";
    let sections = code_map(text);
    let files = set(&["lib/a.rs", "lib/b.rs", "lib/new.rs", "lib/run", "lib/sub/x.rs", "lib/sub/y.rs", "lib/notes.md"]);
    let sources = set(&["lib/a.rs", "lib/b.rs", "lib/new.rs", "lib/run", "lib/sub/x.rs", "lib/sub/y.rs"]);
    assert_eq!(
        check(&sections, &files, &sources),
        [
            "missing: lib/new.rs is a source file but ARCHITECTURE.md's code map does not name it",
            "stale: ARCHITECTURE.md's code map names lib/gone.rs, which is not a file",
        ]
    );
}

#[test]
fn a_source_file_outside_every_section_is_missing() {
    let sections = code_map("## Code map\n### `lib/` — a crate\n- `a.rs`\n");
    let files = set(&["lib/a.rs", "tools/b.py"]);
    assert_eq!(
        check(&sections, &files, &files),
        ["missing: tools/b.py is a source file but ARCHITECTURE.md's code map does not name it"]
    );
}

#[test]
fn a_heading_needs_an_existing_folder() {
    let sections =
        code_map("## Code map\n### `lib/` — a crate\n- `a.rs`\n### `gone/` — old\n### Elsewhere\n- `b.rs`\n");
    let files = set(&["lib/a.rs"]);
    assert_eq!(
        check(&sections, &files, &files),
        [
            "no such folder: `### `gone/` — old` names gone/, which holds no file",
            "heading without a folder: `### Elsewhere` must open with one in backticks"
        ]
    );
}

#[test]
fn scripts_without_an_extension_are_source() {
    assert!(is_source(".ci/run", || b"#!/usr/bin/env bash\n".to_vec()));
    assert!(!is_source(".gitignore", || b"/target\n".to_vec()));
    assert!(!is_source("python/weightferry/py.typed", Vec::new));
    assert!(is_source("src/lib.rs", || unreachable!("an extension decides")));
}
