//! The layering of `src/` (ARCHITECTURE.md, "Layers"): a top-level module
//! (the first path component under `src/`: `src/engine/*.rs` is `engine`,
//! `src/run.rs` and `src/run/` are `run`) names, through `crate::` (or
//! `super::` up to the crate root), only modules of lower layers. Test code
//! (an item under `#[cfg(test)]`) is not counted; comments are, so a doc
//! link is a reference too. Only `main` may use `cli`.
//!
//! std only, and no use of the memfit library: this reads the sources.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The layers, lowest first, from ARCHITECTURE.md's ```layers block: one
/// layer per line, its modules separated by spaces.
fn layer_order(architecture: &str) -> Vec<Vec<String>> {
    let start = architecture
        .find("```layers\n")
        .expect("ARCHITECTURE.md has no ```layers block");
    let body = &architecture[start + "```layers\n".len()..];
    let end = body.find("```").expect("the ```layers block is not closed");
    body[..end]
        .lines()
        .map(|l| l.split_whitespace().map(String::from).collect::<Vec<_>>())
        .filter(|l| !l.is_empty())
        .collect()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The module path of a file under `src/`: `src/backend/cpu/mod.rs` is
/// `[backend, cpu]`, `src/run.rs` is `[run]`.
fn module_path(rel: &Path) -> Vec<String> {
    let mut parts: Vec<String> = rel
        .iter()
        .skip(1)
        .map(|c| c.to_string_lossy().into_owned())
        .collect();
    let last = parts.pop().expect("a file");
    let stem = last.trim_end_matches(".rs");
    if stem != "mod" {
        parts.push(stem.to_string());
    }
    parts
}

/// What each byte of Rust source is: code, comment, or inside a string or
/// character literal.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Code,
    Comment,
    Literal,
}

fn classify(src: &[u8]) -> Vec<Kind> {
    let mut kind = vec![Kind::Code; src.len()];
    let ident = |b: u8| b.is_ascii_alphanumeric() || b == b'_';
    let mut i = 0;
    while i < src.len() {
        let start = i;
        let rest = &src[i..];
        let k = if rest.starts_with(b"//") {
            while i < src.len() && src[i] != b'\n' {
                i += 1;
            }
            Kind::Comment
        } else if rest.starts_with(b"/*") {
            let mut depth = 0;
            while i < src.len() {
                if src[i..].starts_with(b"/*") {
                    depth += 1;
                    i += 2;
                } else if src[i..].starts_with(b"*/") {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            Kind::Comment
        } else if (rest[0] == b'r' || rest.starts_with(b"br"))
            && (i == 0 || !ident(src[i - 1]))
            && {
                let after = if rest[0] == b'b' { 2 } else { 1 };
                let hashes = rest[after..].iter().take_while(|&&b| b == b'#').count();
                rest.get(after + hashes) == Some(&b'"')
            }
        {
            // A raw string: r"..", r#".."#, br#".."#.
            let after = if rest[0] == b'b' { 2 } else { 1 };
            let hashes = rest[after..].iter().take_while(|&&b| b == b'#').count();
            let close: Vec<u8> = std::iter::once(b'"')
                .chain(std::iter::repeat_n(b'#', hashes))
                .collect();
            i += after + hashes + 1;
            while i < src.len() && !src[i..].starts_with(&close) {
                i += 1;
            }
            i += close.len();
            Kind::Literal
        } else if rest[0] == b'"' {
            i += 1;
            while i < src.len() && src[i] != b'"' {
                i += if src[i] == b'\\' { 2 } else { 1 };
            }
            i += 1;
            Kind::Literal
        } else if rest[0] == b'\'' {
            // A character literal ('a', '\n', '\u{1F600}', 'é'), or a lifetime.
            let ch_len = match rest.get(1).copied().unwrap_or(0) {
                0xF0.. => 4,
                0xE0.. => 3,
                0xC0.. => 2,
                _ => 1,
            };
            if rest.get(1) == Some(&b'\\') {
                i += 2;
                while i < src.len() && src[i] != b'\'' {
                    i += 1;
                }
                i += 1;
                Kind::Literal
            } else if rest.get(1 + ch_len) == Some(&b'\'') {
                i += 2 + ch_len;
                Kind::Literal
            } else {
                i += 1;
                Kind::Code
            }
        } else {
            i += 1;
            Kind::Code
        };
        let end = i.min(src.len());
        kind[start..end].fill(k);
    }
    kind
}

/// Blanks every item under `#[cfg(test)]` (a `mod tests { .. }`, a helper
/// `fn`, a `use`), keeping newlines so line numbers stay right.
fn without_test_code(src: &str) -> (Vec<u8>, Vec<Kind>) {
    let mut bytes = src.as_bytes().to_vec();
    let kind = classify(&bytes);
    const ATTR: &[u8] = b"#[cfg(test)]";
    let mut i = 0;
    while i + ATTR.len() <= bytes.len() {
        if kind[i] != Kind::Code || !bytes[i..].starts_with(ATTR) {
            i += 1;
            continue;
        }
        // The item ends at its first `;` outside brackets, or at the brace
        // that closes its first `{` outside parentheses and brackets.
        let mut j = i + ATTR.len();
        let (mut nest, mut braces) = (0i32, 0i32);
        while j < bytes.len() {
            if kind[j] == Kind::Code {
                match bytes[j] {
                    b'(' | b'[' => nest += 1,
                    b')' | b']' => nest -= 1,
                    b'{' if nest == 0 => braces += 1,
                    b'}' if nest == 0 => {
                        braces -= 1;
                        if braces == 0 {
                            break;
                        }
                    }
                    b';' if nest == 0 && braces == 0 => break,
                    _ => {}
                }
            }
            j += 1;
        }
        let end = j.min(bytes.len() - 1);
        for b in &mut bytes[i..=end] {
            if *b != b'\n' {
                *b = b' ';
            }
        }
        i = j + 1;
    }
    (bytes, kind)
}

/// The identifiers a path names right after `at`: `name` or, for
/// `{a::b, c}`, the first segment of each element.
fn names_at(src: &[u8], at: usize) -> Vec<String> {
    let ident = |b: &u8| b.is_ascii_alphanumeric() || *b == b'_';
    let word = |from: usize| -> String {
        src[from..]
            .iter()
            .take_while(|b| ident(b))
            .map(|&b| b as char)
            .collect()
    };
    if src.get(at) != Some(&b'{') {
        return vec![word(at)];
    }
    let mut out = Vec::new();
    let (mut depth, mut expect) = (0, true);
    for (k, &b) in src[at..].iter().enumerate() {
        match b {
            b'{' => {
                depth += 1;
                expect = depth == 1;
            }
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    break;
                }
            }
            b',' if depth == 1 => expect = true,
            b if expect && depth == 1 && ident(&b) => {
                out.push(word(at + k));
                expect = false;
            }
            _ => {}
        }
    }
    out
}

/// `(line, name)` for every top-level name this file's non-test code (and
/// comments) reaches through `crate::` or enough `super::` to get to the
/// crate root.
fn references(src: &str, depth: usize) -> Vec<(usize, String)> {
    let (bytes, kind) = without_test_code(src);
    let line_at = |i: usize| bytes[..i].iter().filter(|&&b| b == b'\n').count() + 1;
    let boundary =
        |i: usize| i == 0 || !(bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_');
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        if kind[i] == Kind::Literal || !boundary(i) {
            i += 1;
            continue;
        }
        if bytes[i..].starts_with(b"crate::") {
            let at = i + "crate::".len();
            out.extend(names_at(&bytes, at).into_iter().map(|n| (line_at(i), n)));
            i = at;
        } else if bytes[i..].starts_with(b"super::") {
            let mut at = i;
            let mut ups = 0;
            while bytes[at..].starts_with(b"super::") {
                ups += 1;
                at += "super::".len();
            }
            if ups >= depth {
                out.extend(names_at(&bytes, at).into_iter().map(|n| (line_at(i), n)));
            }
            i = at;
        } else {
            i += 1;
        }
    }
    out.retain(|(_, n)| !n.is_empty());
    out
}

/// Names at the crate root that are not modules: lib.rs's `pub use m::X`
/// re-exports and `#[macro_export]` macros, each with the module it is from.
fn root_items(files: &[(PathBuf, String)]) -> BTreeMap<String, String> {
    let mut items = BTreeMap::new();
    for (rel, text) in files {
        let module = module_path(rel);
        if module == ["lib"] {
            for l in text.lines() {
                let Some(rest) = l.trim().strip_prefix("pub use ") else {
                    continue;
                };
                let rest = rest.trim_end_matches(';');
                let Some((from, what)) = rest.split_once("::") else {
                    continue;
                };
                for n in what.trim_matches(['{', '}']).split(',') {
                    let n = n.trim().rsplit("::").next().unwrap_or("").to_string();
                    items.insert(n, from.to_string());
                }
            }
        }
        let mut lines = text.lines();
        while let Some(l) = lines.next() {
            if l.trim() == "#[macro_export]"
                && let Some(m) = lines
                    .next()
                    .and_then(|l| l.trim().strip_prefix("macro_rules! "))
            {
                let name = m.trim_end_matches(['{', ' ']);
                items.insert(name.to_string(), module[0].clone());
            }
        }
    }
    items
}

struct Edge {
    file: String,
    line: usize,
    from: String,
    to: String,
}

/// Every cross-module reference in `src/`, and the top-level modules.
fn graph(root: &Path) -> (Vec<Edge>, BTreeSet<String>) {
    let mut paths = Vec::new();
    rust_files(&root.join("src"), &mut paths);
    let files: Vec<(PathBuf, String)> = paths
        .iter()
        .map(|p| {
            let rel = p.strip_prefix(root).unwrap().to_path_buf();
            (rel, fs::read_to_string(p).unwrap())
        })
        .collect();
    let modules: BTreeSet<String> = files
        .iter()
        .map(|(rel, _)| module_path(rel)[0].clone())
        .filter(|m| m != "lib")
        .collect();
    let items = root_items(&files);
    let mut edges = Vec::new();
    for (rel, text) in &files {
        let path = module_path(rel);
        if path == ["lib"] {
            continue;
        }
        for (line, name) in references(text, path.len()) {
            let to = if modules.contains(&name) {
                name
            } else if let Some(m) = items.get(&name) {
                m.clone()
            } else {
                panic!(
                    "{}:{line}: `crate::{name}` is neither a top-level module, a re-export in \
                     lib.rs nor an exported macro; teach tests/layers.rs what it is",
                    rel.display()
                );
            };
            if to != path[0] {
                edges.push(Edge {
                    file: rel.display().to_string(),
                    line,
                    from: path[0].clone(),
                    to,
                });
            }
        }
    }
    (edges, modules)
}

/// What is wrong with `edges` under `layers`, one line each.
fn violations(edges: &[Edge], modules: &BTreeSet<String>, layers: &[Vec<String>]) -> Vec<String> {
    let mut problems = Vec::new();
    let mut layer_of = BTreeMap::new();
    for (n, layer) in layers.iter().enumerate() {
        for m in layer {
            if layer_of.insert(m.clone(), n).is_some() {
                problems.push(format!("`{m}` is listed twice in ARCHITECTURE.md's layers"));
            }
            if !modules.contains(m) {
                problems.push(format!(
                    "ARCHITECTURE.md's layers list `{m}`, which is not a module of src/"
                ));
            }
        }
    }
    for m in modules {
        if !layer_of.contains_key(m) {
            problems.push(format!(
                "module `{m}` is missing from ARCHITECTURE.md's layers: add it to the layer above everything it imports"
            ));
        }
    }
    for e in edges {
        if e.to == "cli" && e.from != "main" {
            problems.push(format!(
                "{}:{}: `{}` imports `cli`; only main.rs may (take an options struct that cli fills)",
                e.file, e.line, e.from
            ));
            continue;
        }
        let (Some(&from), Some(&to)) = (layer_of.get(&e.from), layer_of.get(&e.to)) else {
            continue;
        };
        if to >= from {
            let how = if to == from {
                "the same layer as"
            } else {
                "a layer above"
            };
            problems.push(format!(
                "{}:{}: `{}` (layer {}) imports `{}` ({how} it, layer {}): move what it needs down, or the code up",
                e.file,
                e.line,
                e.from,
                from + 1,
                e.to,
                to + 1
            ));
        }
    }
    problems
}

#[test]
fn modules_import_only_lower_layers() {
    let root = root();
    let arch = fs::read_to_string(root.join("ARCHITECTURE.md")).unwrap();
    let layers = layer_order(&arch);
    let (edges, modules) = graph(&root);
    let problems = violations(&edges, &modules, &layers);
    assert!(
        problems.is_empty(),
        "the layering in ARCHITECTURE.md (\"Layers\") is broken:\n  {}",
        problems.join("\n  ")
    );
}

/// The checker itself: an upward edge, an edge within a layer, a missing
/// module, and `cli` used by a library module are each caught.
#[test]
fn the_checker_catches_what_it_should() {
    let modules: BTreeSet<String> = ["a", "b", "c", "cli", "main"].map(String::from).into();
    let layers: Vec<Vec<String>> = vec![
        vec!["a".into()],
        vec!["b".into(), "c".into()],
        vec!["cli".into()],
        vec!["main".into()],
    ];
    let edge = |from: &str, to: &str| Edge {
        file: format!("src/{from}.rs"),
        line: 7,
        from: from.into(),
        to: to.into(),
    };
    let ok = [edge("b", "a"), edge("main", "cli"), edge("cli", "c")];
    assert_eq!(violations(&ok, &modules, &layers), Vec::<String>::new());
    let up = violations(&[edge("a", "b")], &modules, &layers);
    assert_eq!(up.len(), 1);
    assert!(
        up[0].starts_with("src/a.rs:7: `a` (layer 1) imports `b` (a layer above it, layer 2)"),
        "{up:?}"
    );
    let same = violations(&[edge("b", "c")], &modules, &layers);
    assert!(same[0].contains("the same layer as"), "{same:?}");
    let cli = violations(&[edge("a", "cli")], &modules, &layers);
    assert!(cli[0].contains("only main.rs may"), "{cli:?}");
    let missing = violations(&[], &modules, &layers[..3]);
    assert!(
        missing[0].contains("module `main` is missing"),
        "{missing:?}"
    );
}

/// The source scan: test code is skipped, comments count, strings do not,
/// and `crate::{..}` and `super::` to the root are followed.
#[test]
fn references_are_read_as_rustc_would_resolve_them() {
    let src = r##"
use crate::{alpha::X, beta};
/// See [`crate::gamma`].
fn f() -> &'static str { let c = '{'; "crate::not_this" }
const R: &str = r#"crate::nor_this"#;
use super::super::delta::Y;
#[cfg(test)]
mod tests {
    use crate::epsilon;
    fn g() { let _ = [0u8; 2]; }
}
#[cfg(test)]
use crate::zeta;
use crate::eta::{self, Z};
"##;
    let names: Vec<String> = references(src, 2).into_iter().map(|(_, n)| n).collect();
    assert_eq!(names, ["alpha", "beta", "gamma", "delta", "eta"]);
    // From src/x/y.rs one `super::` stays inside `x`.
    let names: Vec<String> = references("use super::sibling;", 2)
        .into_iter()
        .map(|(_, n)| n)
        .collect();
    assert!(names.is_empty(), "{names:?}");
}

/// `(line, lines, name)` of every `fn` with a body in `src`'s non-test
/// code: from the line of `fn` to the line of the brace that closes its
/// body. A `fn` inside a `macro_rules!` template counts as written.
fn function_lengths(src: &str) -> Vec<(usize, usize, String)> {
    let (bytes, kind) = without_test_code(src);
    let ident = |b: u8| b.is_ascii_alphanumeric() || b == b'_';
    let line_at = |i: usize| bytes[..i].iter().filter(|&&b| b == b'\n').count() + 1;
    let mut out = Vec::new();
    for i in 0..bytes.len().saturating_sub(3) {
        let starts = kind[i] == Kind::Code
            && bytes[i..].starts_with(b"fn ")
            && (i == 0 || !ident(bytes[i - 1]));
        if !starts {
            continue;
        }
        let name: String = bytes[i + 3..]
            .iter()
            .take_while(|&&b| ident(b) || b == b'$')
            .map(|&b| b as char)
            .collect();
        // The body opens at the first `{` outside parentheses and brackets;
        // a `;` first is a declaration without one.
        let (mut j, mut nest) = (i + 3, 0i32);
        let open = loop {
            if j >= bytes.len() {
                break None;
            }
            if kind[j] == Kind::Code {
                match bytes[j] {
                    b'(' | b'[' | b'<' => nest += 1,
                    b')' | b']' | b'>' if bytes[j - 1] != b'-' => nest -= 1,
                    b'{' if nest <= 0 => break Some(j),
                    b';' if nest <= 0 => break None,
                    _ => {}
                }
            }
            j += 1;
        };
        let Some(open) = open else { continue };
        let mut depth = 0i32;
        let mut k = open;
        while k < bytes.len() {
            if kind[k] == Kind::Code {
                match bytes[k] {
                    b'{' => depth += 1,
                    b'}' => {
                        depth -= 1;
                        if depth == 0 {
                            break;
                        }
                    }
                    _ => {}
                }
            }
            k += 1;
        }
        let first = line_at(i);
        out.push((first, line_at(k.min(bytes.len() - 1)) - first + 1, name));
    }
    out
}

/// Issue 25's bound: no function in `src/` is over 150 lines, and the
/// training step's forward and backward (`engine/step.rs`) are under 120:
/// a long function is split where it changes subject.
#[test]
fn no_function_in_src_is_over_150_lines() {
    let mut paths = Vec::new();
    rust_files(&root().join("src"), &mut paths);
    let mut long = Vec::new();
    for p in &paths {
        let text = fs::read_to_string(p).unwrap();
        let rel = p.strip_prefix(root()).unwrap().display().to_string();
        for (line, lines, name) in function_lengths(&text) {
            let step = rel == "src/engine/step.rs" && (name == "forward" || name == "backward");
            if lines > 150 || (step && lines >= 120) {
                long.push(format!("{rel}:{line}: fn {name} is {lines} lines"));
            }
        }
    }
    assert!(long.is_empty(), "{}", long.join("\n"));
}

#[test]
fn function_lengths_are_read_from_fn_to_its_closing_brace() {
    let src = "fn a() -> Vec<u8> {\n    let s = \"}\";\n    vec![]\n}\ntrait T { fn d(&self); }\n#[cfg(test)]\nfn t() {\n}\nfn b<F: Fn() -> u8>(f: F) { '}'; }\n";
    let got = function_lengths(src);
    assert_eq!(
        got,
        [(1, 4, "a".to_string()), (9, 1, "b".to_string())],
        "{got:?}"
    );
}
