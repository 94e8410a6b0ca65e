//! The shape of the sources, checked: no import circle between files and no long library function.
//!
//! - **Import circles** (Rust: the library `src/`, the scheduler `actors/src/`, the harness and the Python
//!   binding's `python/src/`; Python: `python/weightferry/*.py`). A file may use items of its ancestor modules (they
//!   declare it); otherwise the graph of files using each other has no cycle. A Rust file uses another when one of
//!   its `use` declarations or qualified paths (`crate::…`, `super::…`, `self::…`, a child module or an imported
//!   name followed by `::`) names an item defined there; re-exports are followed to the file that defines the item.
//!   A Python module uses another when it imports it (`from . import x`, `from ._x import …`, `import
//!   weightferry._x`), at module level or inside a function (a deferred import hides a circle, it does not remove
//!   it); imports under `if TYPE_CHECKING:` do not run and are not counted.
//! - **Long functions**: no function in `src/` or `actors/src/` (outside `#[cfg(test)]` modules) is longer than
//!   [`MAX_FN_LINES`] lines, counted from its `fn` line to its closing brace.
//!
//! The checker reads the sources as tokens (comments and literals skipped), std only; its own unit tests below
//! feed it small texts with a circle and a long function.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

/// The longest a library function may be, in lines.
const MAX_FN_LINES: usize = 100;

// ---------------------------------------------------------------------------------------------------------------
// Tokens

#[derive(Debug, Clone, PartialEq, Eq)]
enum Tok {
    Ident(String),
    /// `::`
    PathSep,
    Punct(char),
    /// A literal or a lifetime: nothing the checks look at.
    Other,
}

#[derive(Debug, Clone)]
struct Token {
    tok: Tok,
    line: usize,
}

impl Token {
    fn is_ident(&self, s: &str) -> bool {
        matches!(&self.tok, Tok::Ident(i) if i == s)
    }

    fn is_punct(&self, c: char) -> bool {
        self.tok == Tok::Punct(c)
    }

    fn ident(&self) -> Option<&str> {
        match &self.tok {
            Tok::Ident(i) => Some(i),
            _ => None,
        }
    }
}

/// Rust source as tokens with their line numbers; comments and the contents of literals are dropped.
fn lex(src: &str) -> Vec<Token> {
    let b: Vec<char> = src.chars().collect();
    let (mut i, mut line, mut out) = (0usize, 1usize, Vec::new());
    let at = |j: usize| b.get(j).copied().unwrap_or('\0');
    while i < b.len() {
        let c = b[i];
        let start_line = line;
        if c == '\n' {
            line += 1;
            i += 1;
        } else if c.is_whitespace() {
            i += 1;
        } else if c == '/' && at(i + 1) == '/' {
            while i < b.len() && b[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && at(i + 1) == '*' {
            i = skip_block_comment(&b, i, &mut line);
        } else if let Some(end) = raw_string_end(&b, i, &mut line) {
            i = end;
            out.push(Token { tok: Tok::Other, line: start_line });
        } else if c == '"' || ((c == 'b' || c == 'c') && at(i + 1) == '"') {
            i = skip_quoted(&b, if c == '"' { i } else { i + 1 }, '"', &mut line);
            out.push(Token { tok: Tok::Other, line: start_line });
        } else if c == '\'' || (c == 'b' && at(i + 1) == '\'') {
            i = skip_char_or_lifetime(&b, if c == '\'' { i } else { i + 1 });
            out.push(Token { tok: Tok::Other, line: start_line });
        } else if c.is_ascii_digit() {
            while i < b.len() && (b[i].is_alphanumeric() || b[i] == '_' || (b[i] == '.' && at(i + 1).is_ascii_digit()))
            {
                i += 1;
            }
            out.push(Token { tok: Tok::Other, line: start_line });
        } else if c.is_alphabetic() || c == '_' {
            if c == 'r' && at(i + 1) == '#' && (at(i + 2).is_alphabetic() || at(i + 2) == '_') {
                i += 2;
            }
            let s = i;
            while i < b.len() && (b[i].is_alphanumeric() || b[i] == '_') {
                i += 1;
            }
            out.push(Token { tok: Tok::Ident(b[s..i].iter().collect()), line: start_line });
        } else if c == ':' && at(i + 1) == ':' {
            i += 2;
            out.push(Token { tok: Tok::PathSep, line: start_line });
        } else {
            i += 1;
            out.push(Token { tok: Tok::Punct(c), line: start_line });
        }
    }
    out
}

fn skip_block_comment(b: &[char], mut i: usize, line: &mut usize) -> usize {
    let mut depth = 0;
    while i < b.len() {
        if b[i] == '/' && b.get(i + 1) == Some(&'*') {
            depth += 1;
            i += 2;
        } else if b[i] == '*' && b.get(i + 1) == Some(&'/') {
            depth -= 1;
            i += 2;
            if depth == 0 {
                return i;
            }
        } else {
            *line += usize::from(b[i] == '\n');
            i += 1;
        }
    }
    i
}

/// The end of a raw string (`r"…"`, `r#"…"#`, `br"…"`, `cr#"…"#`) starting at `i`, if one starts there.
fn raw_string_end(b: &[char], i: usize, line: &mut usize) -> Option<usize> {
    let mut j = i;
    if matches!(b.get(j), Some('b' | 'c')) {
        j += 1;
    }
    if b.get(j) != Some(&'r') || (i > 0 && (b[i - 1].is_alphanumeric() || b[i - 1] == '_')) {
        return None;
    }
    j += 1;
    let hashes = b[j..].iter().take_while(|c| **c == '#').count();
    j += hashes;
    if b.get(j) != Some(&'"') {
        return None;
    }
    j += 1;
    while j < b.len() {
        if b[j] == '"' && b[j + 1..].iter().take(hashes).filter(|c| **c == '#').count() == hashes {
            return Some(j + 1 + hashes);
        }
        *line += usize::from(b[j] == '\n');
        j += 1;
    }
    Some(j)
}

/// Past the string or character literal whose opening quote is at `i`.
fn skip_quoted(b: &[char], mut i: usize, quote: char, line: &mut usize) -> usize {
    i += 1;
    while i < b.len() && b[i] != quote {
        if b[i] == '\\' {
            *line += usize::from(b.get(i + 1) == Some(&'\n'));
            i += 2;
        } else {
            *line += usize::from(b[i] == '\n');
            i += 1;
        }
    }
    i + 1
}

/// Past a character literal (`'a'`, `'\n'`, `'\u{1F600}'`) or a lifetime (`'a`) whose quote is at `i`.
fn skip_char_or_lifetime(b: &[char], i: usize) -> usize {
    if b.get(i + 1) == Some(&'\\') {
        let mut line = 0;
        return skip_quoted(b, i, '\'', &mut line);
    }
    if b.get(i + 2) == Some(&'\'') {
        return i + 3;
    }
    let mut j = i + 1;
    while j < b.len() && (b[j].is_alphanumeric() || b[j] == '_') {
        j += 1;
    }
    j
}

// ---------------------------------------------------------------------------------------------------------------
// Rust modules, items, imports and paths

type ModId = usize;

/// One module: a file, or an inline `mod name { … }` inside one.
#[derive(Debug, Default)]
struct Module {
    /// The file it lives in.
    file: usize,
    parent: Option<ModId>,
    children: HashMap<String, ModId>,
    /// Names of items it defines.
    items: BTreeSet<String>,
    /// Names its `use` declarations bind, and the path each names.
    bindings: HashMap<String, Vec<String>>,
    /// Paths of its glob imports (`use x::*`).
    globs: Vec<Vec<String>>,
    /// Inside `#[cfg(test)]`.
    test: bool,
}

/// A path a module names: a `use` declaration's leaf (`glob` for `use x::*`) or a qualified path in code.
#[derive(Debug)]
struct PathRef {
    module: ModId,
    segs: Vec<String>,
    line: usize,
    glob: bool,
}

/// A function and its length.
#[derive(Debug, PartialEq, Eq)]
struct FnSpan {
    file: usize,
    name: String,
    line: usize,
    lines: usize,
    test: bool,
}

/// The modules of a set of crates.
#[derive(Debug, Default)]
struct Crates {
    files: Vec<String>,
    modules: Vec<Module>,
    paths: Vec<PathRef>,
    fns: Vec<FnSpan>,
}

impl Crates {
    /// Reads the crates rooted at `roots` (each root's `mod name;` declarations lead to its other files), with
    /// `read` giving a file's text by its path (`None`: no such file).
    fn load(roots: &[&str], read: &dyn Fn(&str) -> Option<String>) -> Crates {
        let mut crates = Crates::default();
        for root in roots {
            let text = read(root).unwrap_or_else(|| panic!("no crate root {root}"));
            crates.add_file(root, &text, None, String::new(), false, read);
        }
        crates
    }

    /// Adds file `path` as a module (child `name` of `parent`), and the files of its `mod name;` declarations.
    fn add_file(
        &mut self,
        path: &str,
        text: &str,
        parent: Option<ModId>,
        name: String,
        test: bool,
        read: &dyn Fn(&str) -> Option<String>,
    ) {
        let file = self.files.len();
        self.files.push(path.to_string());
        let module = self.new_module(file, parent, name, test);
        let tokens = lex(text);
        let mut scan = Scan { crates: self, tokens: &tokens, file, declared: Vec::new() };
        scan.module_body(0, module, 0);
        let declared = std::mem::take(&mut scan.declared);
        for (m, child, child_test, dir) in declared {
            let base = module_dir(path, &dir);
            let candidates = [format!("{base}{child}.rs"), format!("{base}{child}/mod.rs")];
            if let Some((p, t)) = candidates.iter().find_map(|p| read(p).map(|t| (p.clone(), t))) {
                self.add_file(&p, &t, Some(m), child, child_test, read);
            }
        }
    }

    fn new_module(&mut self, file: usize, parent: Option<ModId>, name: String, test: bool) -> ModId {
        let id = self.modules.len();
        self.modules.push(Module { file, parent, test, ..Module::default() });
        if let Some(p) = parent {
            self.modules[p].children.insert(name, id);
        }
        id
    }

    fn is_ancestor(&self, ancestor: ModId, mut m: ModId) -> bool {
        loop {
            if m == ancestor {
                return true;
            }
            match self.modules[m].parent {
                Some(p) => m = p,
                None => return false,
            }
        }
    }

    fn root_of(&self, mut m: ModId) -> ModId {
        while let Some(p) = self.modules[m].parent {
            m = p;
        }
        m
    }

    /// The module a path's first segment starts from, and the segments left; `None` when it names nothing of
    /// this crate (std, another crate, a local variable's type).
    fn start<'s>(&self, module: ModId, segs: &'s [String], depth: usize) -> Option<(Target, &'s [String])> {
        let first = segs.first()?;
        match first.as_str() {
            "crate" => Some((Target::Module(self.root_of(module)), &segs[1..])),
            "self" => Some((Target::Module(module), &segs[1..])),
            "super" => {
                let mut m = module;
                let mut rest = segs;
                while rest.first().map(String::as_str) == Some("super") {
                    m = self.modules[m].parent?;
                    rest = &rest[1..];
                }
                Some((Target::Module(m), rest))
            }
            _ => self.lookup(module, first, module, depth, true).map(|t| (t, &segs[1..])),
        }
    }

    /// What `name` names in module `m`, for a path of module `user`: a child module, an item it defines, or
    /// what an import binds. `strict`: `None` when it names nothing known there (else the item is taken to live
    /// in `m`). An import is followed to the file defining the item when `m` is a facade of it (an ancestor of
    /// the item's module) or an ancestor of `user` (whose imports `user` sees as its own); otherwise naming the
    /// item through `m` uses `m`.
    fn lookup(&self, m: ModId, name: &str, user: ModId, depth: usize, strict: bool) -> Option<Target> {
        let module = &self.modules[m];
        if let Some(&c) = module.children.get(name) {
            return Some(Target::Module(c));
        }
        if module.items.contains(name) {
            return Some(Target::Item(m));
        }
        if depth < 16 {
            let through = |t: Target| {
                let (Target::Module(d) | Target::Item(d)) = t;
                if self.is_ancestor(m, d) || self.is_ancestor(m, user) {
                    t
                } else {
                    Target::Item(m)
                }
            };
            if let Some(path) = module.bindings.get(name) {
                return self.resolve(m, path, depth + 1).map(through);
            }
            for g in &module.globs {
                if let Some(Target::Module(gm)) = self.resolve(m, g, depth + 1) {
                    if gm != m {
                        if let Some(t) = self.lookup(gm, name, m, depth + 1, true) {
                            return Some(through(t));
                        }
                    }
                }
            }
        }
        (!strict).then_some(Target::Item(m))
    }

    /// Where `segs`, named in module `m`, leads.
    fn resolve(&self, m: ModId, segs: &[String], depth: usize) -> Option<Target> {
        let (mut target, rest) = self.start(m, segs, depth)?;
        for seg in rest {
            match target {
                Target::Module(cur) => target = self.lookup(cur, seg, m, depth, false)?,
                Target::Item(_) => break,
            }
        }
        Some(target)
    }

    /// The file-level use graph (test modules included): `(from, to)` → the first line of `from` that uses `to`.
    fn edges(&self) -> BTreeMap<(usize, usize), usize> {
        let mut edges = BTreeMap::new();
        for p in &self.paths {
            let target = match self.resolve(p.module, &p.segs, 0) {
                Some(Target::Item(t)) => t,
                Some(Target::Module(t)) if p.glob => t,
                _ => continue,
            };
            if self.is_ancestor(target, p.module) {
                continue;
            }
            let (from, to) = (self.modules[p.module].file, self.modules[target].file);
            if from != to {
                edges.entry((from, to)).or_insert(p.line);
            }
        }
        edges
    }
}

/// Where a path leads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Target {
    Module(ModId),
    /// An item defined in this module.
    Item(ModId),
}

/// The directory (with a trailing `/`, or empty) holding the files of module `path`'s child modules, with `dir`
/// the inline modules between them.
fn module_dir(path: &str, dir: &[String]) -> String {
    let p = Path::new(path);
    let parent = p.parent().map(|d| d.to_string_lossy().into_owned()).unwrap_or_default();
    let stem = p.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let mut base = if matches!(stem.as_str(), "mod" | "lib" | "main") {
        parent
    } else if parent.is_empty() {
        stem
    } else {
        format!("{parent}/{stem}")
    };
    for d in dir {
        base = if base.is_empty() { d.clone() } else { format!("{base}/{d}") };
    }
    if base.is_empty() {
        base
    } else {
        base + "/"
    }
}

/// Walks one file's tokens, filling in [`Crates`].
struct Scan<'a> {
    crates: &'a mut Crates,
    tokens: &'a [Token],
    file: usize,
    /// `mod name;` declarations: the declaring module, the name, whether under `#[cfg(test)]`, and the inline
    /// modules between the file and the declaration.
    declared: Vec<(ModId, String, bool, Vec<String>)>,
}

/// Keywords that define an item named by the next token.
const ITEM_KEYWORDS: &[&str] = &["fn", "struct", "enum", "trait", "type", "const", "static", "union"];

impl Scan<'_> {
    /// Scans module `m`'s items from token `i` to its closing brace (or the end); returns the index past it.
    /// `inline_depth`: how many inline modules `m` is inside its file (for the files of their `mod name;`).
    fn module_body(&mut self, mut i: usize, m: ModId, inline_depth: usize) -> usize {
        let mut cfg_test = false;
        let mut depth = 0usize;
        while i < self.tokens.len() {
            let t = &self.tokens[i];
            if t.is_punct('#') && self.is_cfg_test(i) {
                cfg_test = true;
            } else if t.is_punct('{') {
                depth += 1;
            } else if t.is_punct('}') {
                if depth == 0 {
                    return i + 1;
                }
                depth -= 1;
                cfg_test &= depth > 0;
            } else if t.is_punct(';') && depth == 0 {
                cfg_test = false;
            }
            if t.is_ident("use") && !self.prev_is_path(i) {
                i = self.use_decl(i + 1, m);
                continue;
            }
            if depth == 0 && t.is_ident("mod") {
                if let Some(next) = self.mod_decl(i, m, cfg_test, inline_depth) {
                    i = next;
                    cfg_test = false;
                    continue;
                }
            }
            if t.is_ident("fn") {
                self.fn_span(i, m);
            }
            if depth == 0 {
                self.item_name(i, m);
            }
            if matches!(t.tok, Tok::Ident(_)) && self.next_is_path(i) && !self.prev_is_path(i) {
                i = self.code_path(i, m);
                continue;
            }
            i += 1;
        }
        i
    }

    fn prev_is_path(&self, i: usize) -> bool {
        i > 0 && self.tokens[i - 1].tok == Tok::PathSep
    }

    fn next_is_path(&self, i: usize) -> bool {
        self.tokens.get(i + 1).is_some_and(|t| t.tok == Tok::PathSep)
    }

    /// Whether the attribute at `i` is `#[cfg(test)]`.
    fn is_cfg_test(&self, i: usize) -> bool {
        let want = [Tok::Punct('['), Tok::Ident("cfg".into()), Tok::Punct('('), Tok::Ident("test".into())];
        self.tokens.get(i + 1..i + 5).is_some_and(|ts| ts.iter().zip(&want).all(|(t, w)| &t.tok == w))
    }

    /// `mod name;` or `mod name { … }` at `i`: records it; returns the index past it.
    fn mod_decl(&mut self, i: usize, m: ModId, test: bool, inline_depth: usize) -> Option<usize> {
        let name = self.tokens.get(i + 1)?.ident()?.to_string();
        let next = self.tokens.get(i + 2)?;
        let test = test || self.crates.modules[m].test;
        if next.is_punct(';') {
            let dir = self.inline_path(m, inline_depth);
            self.declared.push((m, name, test, dir));
            return Some(i + 3);
        }
        if next.is_punct('{') {
            let child = self.crates.new_module(self.file, Some(m), name, test);
            return Some(self.module_body(i + 3, child, inline_depth + 1));
        }
        None
    }

    /// The names of the `depth` inline modules from the file's module down to `m`.
    fn inline_path(&self, mut m: ModId, depth: usize) -> Vec<String> {
        let mut names = Vec::new();
        for _ in 0..depth {
            let Some(p) = self.crates.modules[m].parent else { break };
            if let Some((n, _)) = self.crates.modules[p].children.iter().find(|(_, c)| **c == m) {
                names.push(n.clone());
            }
            m = p;
        }
        names.reverse();
        names
    }

    /// Records the name an item keyword at `i` defines in `m`.
    fn item_name(&mut self, i: usize, m: ModId) {
        let t = &self.tokens[i];
        let defines = t.ident().is_some_and(|k| ITEM_KEYWORDS.contains(&k))
            || (t.is_ident("macro_rules") && self.tokens.get(i + 1).is_some_and(|n| n.is_punct('!')));
        if !defines {
            return;
        }
        let at = if t.is_ident("macro_rules") { i + 2 } else { i + 1 };
        if let Some(name) = self.tokens.get(at).and_then(Token::ident) {
            if !["fn", "unsafe", "async", "extern", "mut"].contains(&name) {
                self.crates.modules[m].items.insert(name.to_string());
            }
        }
    }

    /// Records the span of the function whose `fn` is at `i` (a function pointer type `fn(…)` is none).
    fn fn_span(&mut self, i: usize, m: ModId) {
        let Some(name) = self.tokens.get(i + 1).and_then(Token::ident) else { return };
        let mut j = i + 2;
        let mut nest = 0i32;
        while let Some(t) = self.tokens.get(j) {
            match t.tok {
                Tok::Punct('(' | '[') => nest += 1,
                Tok::Punct(')' | ']') => nest -= 1,
                Tok::Punct(';') if nest == 0 => return,
                Tok::Punct('{') if nest == 0 => break,
                _ => {}
            }
            j += 1;
        }
        let mut depth = 0usize;
        for t in &self.tokens[j..] {
            if t.is_punct('{') {
                depth += 1;
            } else if t.is_punct('}') {
                depth -= 1;
                if depth == 0 {
                    let (line, test) = (self.tokens[i].line, self.crates.modules[m].test);
                    let span = FnSpan { file: self.file, name: name.to_string(), line, lines: t.line - line + 1, test };
                    self.crates.fns.push(span);
                    return;
                }
            }
        }
    }

    /// A qualified path in code starting at `i`; records it and returns the index past it.
    fn code_path(&mut self, mut i: usize, m: ModId) -> usize {
        let line = self.tokens[i].line;
        let mut segs = Vec::new();
        while let Some(name) = self.tokens.get(i).and_then(Token::ident) {
            segs.push(name.to_string());
            if !self.next_is_path(i) {
                i += 1;
                break;
            }
            i += 2;
        }
        self.crates.paths.push(PathRef { module: m, segs, line, glob: false });
        i
    }

    /// A `use` tree from `i` (past `use`) to its `;`: records each leaf path and the name it binds; returns the
    /// index past the `;`.
    fn use_decl(&mut self, i: usize, m: ModId) -> usize {
        let mut leaves = Vec::new();
        let end = parse_use_tree(self.tokens, i, &mut Vec::new(), &mut leaves);
        for leaf in leaves {
            let module = &mut self.crates.modules[m];
            match &leaf.bind {
                Some(name) if name != "_" => {
                    module.bindings.insert(name.clone(), leaf.path.clone());
                }
                Some(_) => {}
                None => module.globs.push(leaf.path.clone()),
            }
            let glob = leaf.bind.is_none();
            self.crates.paths.push(PathRef { module: m, segs: leaf.path, line: leaf.line, glob });
        }
        if self.tokens.get(end).is_some_and(|t| t.is_punct(';')) {
            return end + 1;
        }
        end
    }
}

/// One leaf of a `use` tree: the full path, the name it binds (`None` for a glob) and its line.
struct UseLeaf {
    path: Vec<String>,
    bind: Option<String>,
    line: usize,
}

/// Parses a use tree at `i` under `prefix`; returns the index past it (at the `,`, `}` or `;` after it).
fn parse_use_tree(tokens: &[Token], mut i: usize, prefix: &mut Vec<String>, out: &mut Vec<UseLeaf>) -> usize {
    let depth = prefix.len();
    if tokens.get(i).is_some_and(|t| t.tok == Tok::PathSep) {
        i += 1;
    }
    let line = tokens.get(i).map_or(0, |t| t.line);
    while let Some(t) = tokens.get(i) {
        if t.is_punct('*') {
            out.push(UseLeaf { path: prefix.clone(), bind: None, line });
            i += 1;
            break;
        }
        if t.is_punct('{') {
            i += 1;
            while tokens.get(i).is_some_and(|t| !t.is_punct('}')) {
                i = parse_use_tree(tokens, i, prefix, out);
                if tokens.get(i).is_some_and(|t| t.is_punct(',')) {
                    i += 1;
                }
            }
            i += 1;
            break;
        }
        let Some(name) = t.ident() else { break };
        if name == "self" && depth > 0 && prefix.len() == depth {
            let bind = prefix.last().cloned();
            let (bind, next) = use_rename(tokens, i + 1, bind);
            out.push(UseLeaf { path: prefix.clone(), bind, line });
            i = next;
            break;
        }
        prefix.push(name.to_string());
        if tokens.get(i + 1).is_some_and(|t| t.tok == Tok::PathSep) {
            i += 2;
            continue;
        }
        let (bind, next) = use_rename(tokens, i + 1, Some(name.to_string()));
        out.push(UseLeaf { path: prefix.clone(), bind, line });
        i = next;
        break;
    }
    prefix.truncate(depth);
    i
}

/// `as name` at `i`, if there: the name bound and the index past it.
fn use_rename(tokens: &[Token], i: usize, bind: Option<String>) -> (Option<String>, usize) {
    if tokens.get(i).is_some_and(|t| t.is_ident("as")) {
        let name = tokens.get(i + 1).and_then(Token::ident).map(str::to_string);
        return (name, i + 2);
    }
    (bind, i)
}

// ---------------------------------------------------------------------------------------------------------------
// Cycles

/// The strongly connected components of more than one node of a directed graph on `0..n` (Tarjan).
fn cycles(n: usize, edges: &BTreeSet<(usize, usize)>) -> Vec<Vec<usize>> {
    let mut adj = vec![Vec::new(); n];
    for &(a, b) in edges {
        adj[a].push(b);
    }
    struct T {
        index: Vec<Option<usize>>,
        low: Vec<usize>,
        on: Vec<bool>,
        stack: Vec<usize>,
        next: usize,
        out: Vec<Vec<usize>>,
    }
    fn visit(t: &mut T, adj: &[Vec<usize>], v: usize) {
        t.index[v] = Some(t.next);
        t.low[v] = t.next;
        t.next += 1;
        t.stack.push(v);
        t.on[v] = true;
        for &w in &adj[v] {
            match t.index[w] {
                None => {
                    visit(t, adj, w);
                    t.low[v] = t.low[v].min(t.low[w]);
                }
                Some(iw) if t.on[w] => t.low[v] = t.low[v].min(iw),
                Some(_) => {}
            }
        }
        if Some(t.low[v]) == t.index[v] {
            let mut scc = Vec::new();
            while let Some(w) = t.stack.pop() {
                t.on[w] = false;
                scc.push(w);
                if w == v {
                    break;
                }
            }
            if scc.len() > 1 {
                scc.sort_unstable();
                t.out.push(scc);
            }
        }
    }
    let mut t =
        T { index: vec![None; n], low: vec![0; n], on: vec![false; n], stack: Vec::new(), next: 0, out: vec![] };
    for v in 0..n {
        if t.index[v].is_none() {
            visit(&mut t, &adj, v);
        }
    }
    t.out
}

/// Each import circle of a file graph: its files (sorted) and the lines that make it (`a.rs:12 uses b.rs`).
fn file_cycles(files: &[String], edges: &BTreeMap<(usize, usize), usize>) -> Vec<(Vec<String>, Vec<String>)> {
    let set: BTreeSet<(usize, usize)> = edges.keys().copied().collect();
    let mut out = Vec::new();
    for scc in cycles(files.len(), &set) {
        let names: Vec<String> = scc.iter().map(|&f| files[f].clone()).collect();
        let mut uses = Vec::new();
        for (&(a, b), line) in edges {
            if scc.contains(&a) && scc.contains(&b) {
                uses.push(format!("{}:{line} uses {}", files[a], files[b]));
            }
        }
        let mut sorted = names;
        sorted.sort();
        out.push((sorted, uses));
    }
    out
}

/// The import circles of the Rust crates rooted at `roots`.
fn rust_cycles(roots: &[&str], read: &dyn Fn(&str) -> Option<String>) -> Vec<(Vec<String>, Vec<String>)> {
    let crates = Crates::load(roots, read);
    file_cycles(&crates.files, &crates.edges())
}

/// Functions of the files under `prefixes` longer than [`MAX_FN_LINES`] (outside `#[cfg(test)]`), as
/// `path:line fn name (N lines)`.
fn long_functions(crates: &Crates, prefixes: &[&str]) -> Vec<String> {
    let mut out = Vec::new();
    for f in &crates.fns {
        let path = &crates.files[f.file];
        if f.test || f.lines <= MAX_FN_LINES || !prefixes.iter().any(|p| path.starts_with(p)) {
            continue;
        }
        out.push(format!("{path}:{} fn {} ({} lines)", f.line, f.name, f.lines));
    }
    out
}

// ---------------------------------------------------------------------------------------------------------------
// Python

/// The package modules each module of `package` imports (`package`: module name → source), with the line.
fn python_edges(package: &str, modules: &BTreeMap<String, String>) -> BTreeMap<(String, String), usize> {
    let mut edges = BTreeMap::new();
    for (name, src) in modules {
        for (line, stmt) in python_imports(src) {
            for target in imported_modules(package, &stmt) {
                if &target != name && target != "__init__" && modules.contains_key(&target) {
                    edges.entry((name.clone(), target)).or_insert(line);
                }
            }
        }
    }
    edges
}

/// The import statements of a Python source (joined over parentheses), with their first line; docstrings and
/// blocks under `if TYPE_CHECKING:` skipped.
fn python_imports(src: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut in_doc: Option<&str> = None;
    let mut type_checking: Option<usize> = None;
    let mut open: Option<(usize, String)> = None;
    for (n, raw) in src.lines().enumerate() {
        let code = raw.split('#').next().unwrap_or("");
        if let Some(q) = in_doc {
            if raw.contains(q) {
                in_doc = None;
            }
            continue;
        }
        let trimmed = code.trim();
        for q in ["\"\"\"", "'''"] {
            if trimmed.starts_with(q) && trimmed.matches(q).count() == 1 {
                in_doc = Some(q);
            }
        }
        if in_doc.is_some() {
            continue;
        }
        if let Some((line, mut stmt)) = open.take() {
            stmt.push(' ');
            stmt.push_str(trimmed);
            if trimmed.contains(')') {
                out.push((line, stmt));
            } else {
                open = Some((line, stmt));
            }
            continue;
        }
        let indent = code.len() - code.trim_start().len();
        if trimmed.is_empty() {
            continue;
        }
        if type_checking.is_some_and(|i| indent <= i) {
            type_checking = None;
        }
        if trimmed.starts_with("if TYPE_CHECKING") || trimmed.starts_with("if typing.TYPE_CHECKING") {
            type_checking = Some(indent);
            continue;
        }
        if type_checking.is_some() || !(trimmed.starts_with("from ") || trimmed.starts_with("import ")) {
            continue;
        }
        if trimmed.contains('(') && !trimmed.contains(')') {
            open = Some((n + 1, trimmed.to_string()));
        } else {
            out.push((n + 1, trimmed.to_string()));
        }
    }
    out
}

/// The modules of `package` one import statement names (they may not exist).
fn imported_modules(package: &str, stmt: &str) -> Vec<String> {
    let clean = stmt.replace(['(', ')'], " ");
    let words: Vec<&str> = clean.split_whitespace().collect();
    let names_after = |k: usize| -> Vec<String> {
        words[k..].join(" ").split(',').filter_map(|s| s.split_whitespace().next()).map(str::to_string).collect()
    };
    match words.as_slice() {
        ["from", from, "import", ..] => {
            let sub = if *from == "." || *from == package {
                return names_after(3);
            } else if let Some(rest) = from.strip_prefix('.') {
                rest
            } else if let Some(rest) = from.strip_prefix(&format!("{package}.")) {
                rest
            } else {
                return Vec::new();
            };
            sub.split('.').next().map(str::to_string).into_iter().collect()
        }
        ["import", ..] => names_after(1)
            .iter()
            .filter_map(|m| m.strip_prefix(&format!("{package}.")))
            .filter_map(|m| m.split('.').next())
            .map(str::to_string)
            .collect(),
        _ => Vec::new(),
    }
}

/// The import circles of a Python package (`dir`: its directory, for the names).
fn python_cycles(package: &str, dir: &str, modules: &BTreeMap<String, String>) -> Vec<(Vec<String>, Vec<String>)> {
    let names: Vec<String> = modules.keys().cloned().collect();
    let index: HashMap<&String, usize> = names.iter().enumerate().map(|(i, n)| (n, i)).collect();
    let edges =
        python_edges(package, modules).into_iter().map(|((a, b), line)| ((index[&a], index[&b]), line)).collect();
    let files: Vec<String> = names.iter().map(|n| format!("{dir}/{n}.py")).collect();
    file_cycles(&files, &edges)
}

// ---------------------------------------------------------------------------------------------------------------
// The checks on this repository

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read_repo(path: &str) -> Option<String> {
    std::fs::read_to_string(repo().join(path)).ok()
}

/// The Rust crate roots whose files must not import in a circle.
const RUST_ROOTS: &[&str] =
    &["src/lib.rs", "actors/src/lib.rs", "harness/lib.rs", "harness/main.rs", "python/src/lib.rs"];

fn report_cycles(found: Vec<(Vec<String>, Vec<String>)>) -> Vec<String> {
    found.into_iter().map(|(files, uses)| format!("{}:\n    {}", files.join(" <-> "), uses.join("\n    "))).collect()
}

#[test]
fn no_rust_import_circles() {
    let found = report_cycles(rust_cycles(RUST_ROOTS, &read_repo));
    assert!(
        found.is_empty(),
        "import circles between files (move the shared item into its own file):\n{}",
        found.join("\n")
    );
}

#[test]
fn no_python_import_circles() {
    let dir = "python/weightferry";
    let mut modules = BTreeMap::new();
    for entry in std::fs::read_dir(repo().join(dir)).expect("python/weightferry") {
        let path = entry.expect("a directory entry").path();
        if path.extension().is_some_and(|e| e == "py") {
            let name = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
            modules.insert(name, std::fs::read_to_string(&path).expect("a Python module"));
        }
    }
    let found = report_cycles(python_cycles("weightferry", dir, &modules));
    assert!(found.is_empty(), "import circles between Python modules:\n{}", found.join("\n"));
}

#[test]
fn no_long_library_functions() {
    let crates = Crates::load(&["src/lib.rs", "actors/src/lib.rs"], &read_repo);
    let long = long_functions(&crates, &["src/", "actors/src/"]);
    assert!(
        long.is_empty(),
        "library functions over {MAX_FN_LINES} lines (split them by what they decide):\n{}",
        long.join("\n")
    );
}

// ---------------------------------------------------------------------------------------------------------------
// The checker's own tests

fn from_map(files: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let map: HashMap<String, String> = files.iter().map(|(p, t)| (p.to_string(), t.to_string())).collect();
    move |p: &str| map.get(p).cloned()
}

#[test]
fn finds_a_two_file_circle() {
    let read = from_map(&[
        ("lib.rs", "pub mod a;\npub mod b;\n"),
        ("a.rs", "use crate::b::B;\npub struct A;\n"),
        ("b.rs", "pub struct B;\nfn f() -> crate::a::A { todo!() }\n"),
    ]);
    let found = rust_cycles(&["lib.rs"], &read);
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0].0, vec!["a.rs".to_string(), "b.rs".to_string()]);
    assert_eq!(found[0].1, vec!["a.rs:1 uses b.rs".to_string(), "b.rs:2 uses a.rs".to_string()]);
}

#[test]
fn follows_reexports_and_lets_a_file_use_its_ancestors() {
    let read = from_map(&[
        ("lib.rs", "pub mod d;\npub mod e;\n"),
        // d's facade re-exports its children; e uses d's item through it, d/b uses e: no circle, since e reaches
        // d/a.rs (where the item lives), not d/b.rs.
        ("d/mod.rs", "mod a;\nmod b;\npub use a::A;\npub use self::b::B;\npub struct Top;\n"),
        ("d/a.rs", "pub struct A;\nuse super::Top;\n"),
        ("d/b.rs", "pub struct B(crate::e::E, super::Top);\n"),
        ("e.rs", "use crate::d::A;\npub struct E(A);\n"),
    ]);
    assert!(rust_cycles(&["lib.rs"], &read).is_empty());
    // e now names d/b.rs's item: a circle e.rs <-> d/b.rs.
    let read = from_map(&[
        ("lib.rs", "pub mod d;\npub mod e;\n"),
        ("d/mod.rs", "mod a;\nmod b;\npub use a::A;\npub use self::b::B;\n"),
        ("d/a.rs", "pub struct A;\n"),
        ("d/b.rs", "/* crate::e::E in a comment */ pub struct B(crate::e::E);\n"),
        ("e.rs", "pub struct E(Box<crate::d::B>);\n"),
    ]);
    let found = rust_cycles(&["lib.rs"], &read);
    assert_eq!(found.iter().map(|c| c.0.clone()).collect::<Vec<_>>(), vec![vec!["d/b.rs", "e.rs"]]);
}

#[test]
fn a_reexport_of_a_sibling_item_is_a_use_of_the_reexporting_file() {
    // q is no facade of r: p naming r's item through q uses q.
    let read = from_map(&[
        ("lib.rs", "pub mod p;\npub mod q;\npub mod r;\n"),
        ("p.rs", "pub struct P(crate::q::R);\n"),
        ("q.rs", "pub use crate::r::R;\npub fn f(_: super::p::P) {}\n"),
        ("r.rs", "pub struct R;\n"),
    ]);
    let found = rust_cycles(&["lib.rs"], &read);
    assert_eq!(found.iter().map(|c| c.0.clone()).collect::<Vec<_>>(), vec![vec!["p.rs", "q.rs"]]);
}

#[test]
fn finds_a_long_function_but_not_in_tests() {
    let body = "    let x = 1;\n".repeat(99);
    let src = format!(
        "pub fn short() {{\n{}}}\n\npub fn long(a: u8) -> u8 {{\n{body}    a\n}}\n\n#[cfg(test)]\nmod tests {{\n    fn \
         long_test() {{\n{body}{body}    }}\n}}\n",
        "    let s = \"}\";\n".repeat(98)
    );
    let read = from_map(&[("src/lib.rs", &src)]);
    let crates = Crates::load(&["src/lib.rs"], &read);
    assert_eq!(long_functions(&crates, &["src/"]), vec!["src/lib.rs:102 fn long (102 lines)".to_string()]);
    assert!(long_functions(&crates, &["harness/"]).is_empty());
}

#[test]
fn lexer_skips_literals_and_comments() {
    let toks = lex("let s = r#\"crate::x \"# ; /* a /* b */ c */ 'a' '\\'' <'b> b\"}\" // crate::y\nfoo::bar");
    let idents: Vec<&str> = toks.iter().filter_map(Token::ident).collect();
    assert_eq!(idents, vec!["let", "s", "foo", "bar"]);
    assert_eq!(toks.last().map(|t| t.line), Some(2));
}

#[test]
fn finds_a_python_circle() {
    let mut modules = BTreeMap::new();
    modules.insert("__init__".to_string(), "from ._a import f\nfrom ._b import g\n".to_string());
    modules.insert("_a".to_string(), "\"\"\"Docs.\n\nfrom ._b import no\n\"\"\"\nfrom . import _core\n".to_string());
    modules.insert(
        "_b".to_string(),
        "import os\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ._a import f\n".to_string(),
    );
    assert!(python_cycles("pkg", "pkg", &modules).is_empty());
    modules.insert("_b".to_string(), "def g():\n    from ._a import (\n        f,\n    )\n".to_string());
    modules.insert("_a".to_string(), "import pkg._b as b\n".to_string());
    let found = python_cycles("pkg", "pkg", &modules);
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0].0, vec!["pkg/_a.py".to_string(), "pkg/_b.py".to_string()]);
    assert_eq!(found[0].1, vec!["pkg/_a.py:1 uses pkg/_b.py".to_string(), "pkg/_b.py:2 uses pkg/_a.py".to_string()]);
}
